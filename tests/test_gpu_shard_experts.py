"""``train.shard_experts`` on one GPU: 4 gloo ranks (dp 2 × ep 2) sharing the device, as
``tests/test_gpu_ranks.py`` runs them (``device=cuda train.dist_backend=gloo``). Skipped without CUDA.

20 steps of the tiny V3-shaped model on a text of exactly one global batch (every step trains on
all 8 windows, whatever the rank count), ``dispatcher=a2a dispatcher.ep_size=2``:

* fp32 (``gemm=loop``), ``model.num_token_chunks=2`` with ``recompute_fc1`` and folded routing
  weights: the sharded run's losses equal the replicated run's within a relative 1e-5 and one
  process's within 2e-4 (the bound of ``tests/test_gpu_ranks.py``);
* bf16 (``gemm=torch``, FSDP2's bf16 gathers and fp32 reduce-scatters against the replicated
  path's fp32 main gradients) with ``train.shard_dense``: each step's loss within a relative 2e-2
  of the replicated bf16 run's;
* the fp32 sharded run's step-10 checkpoint resumes in one process (``dispatcher=local``, EP 1) to
  the uninterrupted run's losses within 2e-4.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.test_gpu_ranks import STEPS, _close, _finish, _launch, _text

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EP2 = ["dispatcher=a2a", "dispatcher.ep_size=2"]
MEMORY = ["model.num_token_chunks=2", "model.recompute_fc1=true", "model.fold_routing_weights=true"]
BF16 = ["train.dtype=bf16", "gemm=torch", "train.shard_dense=true"]


def test_dp2_ep2_on_one_gpu_trains_like_replicated_and_resumes_at_ep1(tmp_path):
    text = _text(tmp_path)
    no_ckpt = "train.ckpt_every=0"
    runs = {"one": (1, ["dispatcher=local", *MEMORY, no_ckpt]),
            "replicated": (4, [*EP2, *MEMORY, no_ckpt]),
            "sharded": (4, [*EP2, *MEMORY, "train.shard_experts=true", "train.ckpt_every=10", "train.ckpt_keep=0"]),
            "replicated_bf16": (4, [*EP2, *BF16, no_ckpt]),
            "sharded_bf16": (4, [*EP2, *BF16, "train.shard_experts=true", no_ckpt])}
    procs = {n: _launch(tmp_path / n, k, text, f"train.steps={STEPS}", *x) for n, (k, x) in runs.items()}
    losses = _finish(procs, tmp_path, timeout=900)
    steps = range(1, STEPS + 1)
    assert sorted(losses["sharded"]) == list(steps)
    for s in steps:
        rel = abs(losses["sharded"][s] - losses["replicated"][s]) / abs(losses["replicated"][s])
        assert rel <= 1e-5, (s, losses["sharded"][s], losses["replicated"][s])
        rel = abs(losses["sharded_bf16"][s] - losses["replicated_bf16"][s]) / abs(losses["replicated_bf16"][s])
        assert rel <= 2e-2, (s, losses["sharded_bf16"][s], losses["replicated_bf16"][s])
    _close(losses["sharded"], losses["one"], steps, "sharded")
    ckpt = tmp_path / "sharded" / "checkpoints" / "step_00000010"
    assert ckpt.is_dir()
    (tmp_path / "resume1" / "checkpoints").mkdir(parents=True)
    shutil.copytree(ckpt, tmp_path / "resume1" / "checkpoints" / ckpt.name)
    resumed = _finish({"resume1": _launch(tmp_path / "resume1", 1, text, f"train.steps={STEPS}", "dispatcher=local",
                                          *MEMORY, "train.ckpt_every=0", "resume=true")}, tmp_path)
    assert sorted(resumed["resume1"]) == list(range(11, STEPS + 1))
    _close(resumed["resume1"], losses["one"], range(11, STEPS + 1), "resume1")
