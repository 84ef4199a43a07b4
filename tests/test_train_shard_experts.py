"""``train.shard_experts``: each EP rank's routed experts FSDP2-sharded over the dp ranks holding them.

On gloo ranks (:func:`tests.dist_harness.run_world`), whole Trainer runs of a tiny DeepSeek-V3 shape
with ``num_token_chunks=2``, the memory options, gradient accumulation and an active gradient clip:

* dp 2 × ep 2 (``a2a``) and dp 4 × ep 2 (``agrs``): 20 steps sharded against 20 steps replicated, in
  the same process group: losses and gradient norms within a relative 1e-5, the clipped expert
  gradients each step within 1e-5 of their norm, the router biases bitwise (the two runs
  differ only in the order the gradient reductions and the norm add up, which moves the clip
  coefficient in its last bits);
* the sharded run's checkpoint (each expert weight and moment one global ``[E, ...]`` tensor)
  resumed at another dp size (dp 1 × ep 2 from dp 2; dp 2 × ep 2 from dp 4) and at EP 1 in one
  process (``dispatcher=local``): the experts, their AdamW moments, the router biases and the step
  are the saved ones, bitwise;
* the global gradient norm at dp 2 × ep 2, sharded and replicated, against one process's norm of
  the same batch (float64), and the clipped gradients after it, with the experts sharded on dim 0
  (4 local experts over dp 2) and on dim 1 (1 local expert over dp 2); before the clip the sharded
  expert gradients equal the replicated ones bitwise (a sum of two ranks, then ``/ world``, either way).

Bad input (``local``, ``fsdp``, a dp size that cannot split the experts) is a ConfigError naming
``train.shard_experts`` and the sizes, before any work; ``dropless-train`` exits 2.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dropless.config import ConfigError
from dropless.convert import args_from_hf_config, load_hf, read_hf_config, save_model_dcp
from dropless.dispatch.a2a import A2ADispatcher
from dropless.dispatch.agrs import AGRSDispatcher
from dropless.model import Transformer
from dropless.train.config import compose, model_args
from dropless.train.dist import DistEnv
from dropless.train.shard import expert_shard_dim
from dropless.train.startup import check_train_config, shard_experts_note
from dropless.train.trainer import Trainer
from tests import dist_harness as H
from tests import shard_experts_worker as W
from tests.hf_tiny import make_hf_dir
from tests.test_train import _env

STEPS = 20
MEMORY = ["model.num_token_chunks=2", "model.recompute_fc1=true", "model.fold_routing_weights=true"]


def _check_equivalent(out: dict) -> None:
    a, b = out["replicated"], out["sharded"]
    assert set(a["sharded_params"]) == {"Parameter"} and set(b["sharded_params"]) == {"DTensor"}, (a, b)
    assert len(a["loss"]) == len(b["loss"]) == STEPS
    for step in range(STEPS):
        assert b["loss"][step] == pytest.approx(a["loss"][step], rel=1e-5, abs=0), step
        assert b["grad_norm"][step] == pytest.approx(a["grad_norm"][step], rel=1e-5, abs=0), step
        for name, want in a["grads"][step].items():
            got = b["grads"][step][name]
            assert got.shape == want.shape, name
            assert (got - want).norm() <= 1e-5 * want.norm(), (step, name)
        for x, y in zip(a["bias"][step], b["bias"][step]):
            assert torch.equal(x, y), step
    assert a["grad_norm"][0] > 0.05  # optim.grad_clip=0.05 clips: the clip is part of what is compared


def _check_loaded(saved: dict, loaded: dict) -> None:
    assert loaded["step"] == saved["step"] == STEPS
    for x, y in zip(saved["bias"], loaded["bias"]):
        assert torch.equal(x, y)
    keys = [k for k in saved if k not in ("step", "bias")]
    assert keys and all(k in loaded for k in keys)
    for k in keys:
        assert saved[k] is not None and torch.equal(saved[k], loaded[k]), k


@pytest.mark.slow
def test_dp2_ep2_trains_like_replicated_and_resumes_at_dp1_and_ep1(tmp_path, monkeypatch):
    res = H.run_world("tests.shard_experts_worker:equivalence_worker", 4, "a2a", 2, STEPS, str(tmp_path), MEMORY,
                      True, deadline_s=900, pg_timeout_s=180)
    out = res[0]
    _check_equivalent(out)
    assert out["sharded"]["local_numel"] * 2 == out["replicated"]["local_numel"]  # 1/dp of the local experts
    W.copy_checkpoint(tmp_path / "sharded_4", tmp_path / "dp1")
    again = H.run_world("tests.shard_experts_worker:resume_worker", 2, "a2a", 2, str(tmp_path / "dp1"),
                        ["train.shard_experts=true", *MEMORY], deadline_s=300, pg_timeout_s=120)
    _check_loaded(out["saved"], again[0])
    W.copy_checkpoint(tmp_path / "sharded_4", tmp_path / "ep1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    tr = Trainer(compose(W.COMMON + MEMORY + ["dispatcher=local", "train.steps=40", "resume=true",
                                             f"run_dir={tmp_path / 'ep1'}"]))
    try:
        _check_loaded(out["saved"], W.expert_state(tr))
    finally:
        tr.close()


@pytest.mark.slow
def test_dp4_ep2_trains_like_replicated_and_resumes_at_dp2(tmp_path):
    extra = ["model.num_token_chunks=2", "model.recompute_swiglu=true", "train.activation_checkpointing=true"]
    res = H.run_world("tests.shard_experts_worker:equivalence_worker", 8, "agrs", 2, STEPS, str(tmp_path), extra,
                      True, deadline_s=1200, pg_timeout_s=300)
    out = res[0]
    _check_equivalent(out)
    assert out["sharded"]["local_numel"] * 4 == out["replicated"]["local_numel"]
    W.copy_checkpoint(tmp_path / "sharded_8", tmp_path / "dp2")
    again = H.run_world("tests.shard_experts_worker:resume_worker", 4, "agrs", 2, str(tmp_path / "dp2"),
                        ["train.shard_experts=true", *extra], deadline_s=300, pg_timeout_s=120)
    _check_loaded(out["saved"], again[0])


@pytest.mark.parametrize("n_experts, placement", [(8, "Shard(dim=0)"), (2, "Shard(dim=1)")])
def test_grad_norm_and_clip_count_every_expert_shard_once(n_experts, placement):
    max_norm = 0.05
    ref = W.reference_grads(4, n_experts, max_norm)
    res = H.run_world("tests.shard_experts_worker:grad_norm_worker", 4, 2, n_experts, max_norm, deadline_s=300)
    assert ref["norm"] > 2 * max_norm  # the clip scales
    for r in range(4):
        out = res[r]
        assert out["sharded"]["placements"] and all(placement in p for p in out["sharded"]["placements"])
        for k, want in out["replicated"]["unclipped"].items():  # a sum of two ranks either way: bitwise
            assert torch.equal(out["sharded"]["unclipped"][k], want), (r, k)
        for name in ("replicated", "sharded"):
            assert out[name]["norm"] == pytest.approx(ref["norm"], rel=2e-6), (r, name)
            for k, want in ref["grads"].items():
                got = out[name]["grads"][k]
                assert (got - want).norm() <= 2e-6 * want.norm(), (r, name, k)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("disp, named", [("local", "dispatcher=local"), ("fsdp", "dispatcher=fsdp")])
def test_shard_experts_needs_an_expert_parallel_dispatcher(disp, named):
    with pytest.raises(ConfigError) as err:
        check_train_config(compose(W.COMMON + [f"dispatcher={disp}", "train.shard_experts=true"]))
    assert "train.shard_experts" in str(err.value) and named in str(err.value)


def test_a_dp_size_that_cannot_split_the_experts_is_refused_before_any_work(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")  # dp 3 x ep 2: 4 local experts, H 32, I 16, none a multiple of 3
    with pytest.raises(ConfigError) as err:
        check_train_config(compose(W.COMMON + ["dispatcher=a2a", "dispatcher.ep_size=2", "train.shard_experts=true"]))
    msg = str(err.value)
    assert "train.shard_experts" in msg and "dp size 3" in msg and "4 local experts" in msg
    assert "model.hidden_size=32" in msg and "model.moe_intermediate_size=16" in msg


def test_shard_dim_follows_the_sizes():
    assert expert_shard_dim(A2ADispatcher, 2, 2, 8, 32, 16) == 0       # 4 local experts over dp 2
    assert expert_shard_dim(AGRSDispatcher, 8, 2, 8, 32, 16) == 1      # 4 local experts over dp 8: split H and I
    assert expert_shard_dim(A2ADispatcher, 1, 8, 8, 30, 10) == 0       # dp 1: nothing to split
    with pytest.raises(ConfigError, match="train.shard_experts"):
        expert_shard_dim(A2ADispatcher, 8, 2, 8, 32, 12)               # I = 12 over dp 8


def test_cli_exits_2_naming_the_option():
    r = subprocess.run([sys.executable, "-m", "dropless.train", *W.COMMON, "dispatcher=local",
                        "train.shard_experts=true", "train.steps=1"], capture_output=True, text=True, env=_env(),
                       timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "train.shard_experts" in r.stderr + r.stdout


def test_weights_import_into_experts_sharded_over_dp(tmp_path):
    """``init_from`` (Hugging Face files and a DCP weights checkpoint) at dp 2 × ep 2 with the experts
    FSDP2-sharded: each rank reads only its EP rank's experts and the weights equal one process's import."""
    hf_dir = tmp_path / "hf"
    make_hf_dir(hf_dir, mtp=1, max_shard_size="40KB")
    args, _ = args_from_hf_config(read_hf_config(hf_dir))
    full = Transformer(args)
    load_hf(full, hf_dir)
    ref = full.state_dict()
    dcp_dir = save_model_dcp(full, tmp_path / "dcp")
    res = H.run_world("tests.shard_experts_worker:import_worker", 4, 2, str(hf_dir), str(dcp_dir), deadline_s=300)
    e = args.n_routed_experts // 2
    for r, out in enumerate(res):
        assert out["hf_placements"] and all("Shard(dim=0)" in p for p in out["hf_placements"])
        experts_read = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in out["names_read"]
                        if ".mlp.experts." in n}
        assert experts_read == set(range((r % 2) * e, (r % 2) * e + e))   # its EP rank's experts only
        for src in ("hf", "dcp"):
            assert out[src]
            for k, v in out[src].items():
                assert torch.equal(v, ref[k]), (r, src, k)


def test_token_chunks_gather_once_per_chunk_and_reduce_scatter_once():
    """What dropless-plan and the start-up note say of model.num_token_chunks: per MoE layer, a gather per
    chunk in forward and in backward, one gradient reduce-scatter."""
    out = H.run_world("tests.shard_experts_worker:collectives_worker", 4, 2, deadline_s=300)[0]
    layers = out[1]["moe_layers"]
    assert out[1] == {"gathers": 2 * layers, "reduce_scatters": layers, "moe_layers": layers}
    assert out[2] == {"gathers": 4 * layers, "reduce_scatters": layers, "moe_layers": layers}


@pytest.mark.parametrize("world, ep, chunks, named", [(4, 4, 1, "dp 1"), (4, 2, 2, "model.num_token_chunks=2"),
                                                      (4, 2, 1, None)])
def test_start_up_note_for_dp1_and_token_chunks(world, ep, chunks, named):
    cfg = compose(W.COMMON + ["dispatcher=a2a", "train.shard_experts=true", f"model.num_token_chunks={chunks}"])
    env = DistEnv(0, world, 0, world, torch.device("cpu"), ep, world // ep)
    note = shard_experts_note(cfg, model_args(cfg), env)
    if named is None:
        assert note is None
    else:
        assert note is not None and named in note and "train.shard_experts" in note
