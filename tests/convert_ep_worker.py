"""Worker of tests/test_convert_ep.py, in a module of its own so that the spawned ranks do not
import transformers (the checkpoint is made by the parent)."""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from dropless.convert import args_from_hf_config, load_hf, read_hf_config
from dropless.convert.start import init_from
from dropless.dispatch import build_dispatcher
from dropless.dispatch.mesh import build_mesh
from dropless.model import Transformer
from dropless.train.shard import shard_dense_params

WORLD = 2


def worker(rank, world, hf_dir, dcp_dir):
    """On each rank, under the harness's gloo group (tests/dist_harness.py ``run_world``): the
    model imported three ways; returns each one's full state dict and what was read."""
    mesh = build_mesh(world, world, "cpu")
    args, _ = args_from_hf_config(read_hf_config(hf_dir))
    res = {}
    for src in ("hf", "dcp", "hf_sharded"):
        model = Transformer(args, dispatcher_factory=lambda layer_id: build_dispatcher("a2a", args, ep_group=mesh))
        model.init_weights(seed=99)
        if src.endswith("sharded"):  # train.shard_dense: the non-expert weights are FSDP2 DTensors
            shard_dense_params(model, world, "cpu")
        if src.startswith("hf"):
            rep = load_hf(model, hf_dir)
            res.setdefault("names_read", rep.names_read)
        else:
            init_from(model, dcp_dir, mesh=mesh)
        res[src] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                    for k, v in model.state_dict().items()}
        res[src + "_dtensors"] = sum(isinstance(v, DTensor) for v in model.state_dict().values())
    res["offsets"] = [m.experts.expert_offset for m in model.moe_layers()]
    return res
