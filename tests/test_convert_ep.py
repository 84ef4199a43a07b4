"""Import under expert parallelism (2 gloo ranks, CPU): each rank reads only its own experts'
tensors from the Hugging Face files (counted), and gets the same weights as a one-process
import; a DCP weights checkpoint loads the same way (``init_from`` under EP); and the Hugging
Face import again with the non-expert weights FSDP2-sharded (``train.shard_dense``: DTensors)."""

from __future__ import annotations

import torch

from dropless.convert import args_from_hf_config, load_hf, read_hf_config, save_model_dcp
from dropless.model import Transformer
from tests import convert_ep_worker
from tests import dist_harness as H
from tests.hf_tiny import make_hf_dir

WORLD = convert_ep_worker.WORLD


def test_ep_ranks_read_only_their_experts(tmp_path):
    hf_dir = tmp_path / "hf"
    make_hf_dir(hf_dir, mtp=1, max_shard_size="40KB")
    args, _ = args_from_hf_config(read_hf_config(hf_dir))
    full = Transformer(args)
    rep = load_hf(full, hf_dir)
    ref = full.state_dict()
    dcp_dir = save_model_dcp(full, tmp_path / "dcp")
    n_moe = len(full.moe_layers())                         # 2 main + 1 MTP
    E = args.n_routed_experts
    non_expert = rep.tensors_read - 3 * E * n_moe

    results = H.run_world("tests.convert_ep_worker:worker", WORLD, str(hf_dir), str(dcp_dir), deadline_s=180)
    for r, res in enumerate(results):
        assert "error" not in res, res.get("error")
        e = E // WORLD
        assert res["offsets"] == [r * e] * n_moe
        experts_read = [n for n in res["names_read"] if ".mlp.experts." in n]
        assert len(res["names_read"]) == non_expert + 3 * e * n_moe       # its experts only, nothing twice
        assert {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in experts_read} == set(range(r * e, r * e + e))
        assert res["hf_dtensors"] == res["dcp_dtensors"] == 0 and res["hf_sharded_dtensors"] > 10
        for src in ("hf", "dcp", "hf_sharded"):
            for k, v in res[src].items():
                if k.endswith((".experts.w13", ".experts.w2")):
                    assert torch.equal(v, ref[k][r * e:(r + 1) * e]), (src, k)
                elif not k.endswith("tokens_per_expert"):
                    assert torch.equal(v, ref[k]), (src, k)
