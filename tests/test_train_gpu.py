"""The training step on one GPU (skipped without CUDA): no host sync but the one metrics read.

A whole :meth:`Trainer.train_step` (pinned, non-blocking input copies, forward, backward with
the main-gradient hooks, grad norm, clipping, fused AdamW, the router-bias hook, the bf16
refresh, the scheduler) of a tiny bf16 config runs under
``torch.cuda.set_sync_debug_mode("error")``; only :meth:`Trainer._read_metrics` (the step's one
``.tolist()``) runs with the mode off, and it runs exactly once per step, also when
:meth:`Trainer.iter_steps` pipelines the steps. Also on the GPU:
fused AdamW is picked, and ``train.compile=true`` gives eager's losses.
"""

from __future__ import annotations

import pytest
import torch

from dropless.train.config import compose
from dropless.train.trainer import Trainer

pytestmark = pytest.mark.gpu

GPU = ["device=cuda", "train.dtype=bf16", "train.micro_batch_size=4", "train.seq_len=64", "train.grad_accum=2",
       "optim.warmup_steps=2", "train.val_every=0", "train.ckpt_every=0", "logging.mode=disabled",
       "logging.progress=false"]


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_train_step_syncs_only_for_its_metrics(tmp_path):
    _need_cuda()
    tr = Trainer(compose(GPU + [f"run_dir={tmp_path}", "train.steps=5"]))
    reads = []
    plain = tr._read_metrics

    def read(values):
        torch.cuda.set_sync_debug_mode("default")
        try:
            reads.append(1)
            return plain(values)
        finally:
            torch.cuda.set_sync_debug_mode("error")
    tr._read_metrics = read
    try:
        tr.train_step()                 # warm-up: lazy init, allocator, cuBLAS handles, AdamW state
        torch.cuda.synchronize()
        reads.clear()
        torch.cuda.set_sync_debug_mode("error")
        try:
            recs = [tr.train_step() for _ in range(2)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len(reads) == 2
        reads.clear()
        torch.cuda.set_sync_debug_mode("error")
        try:  # pipelined (as Trainer.train runs): each step's read after the next one's forward and backward
            recs += list(tr.iter_steps(tr.step + 2))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len(reads) == 2 and [r["tokens"] for r in recs[2:]] == [4 * tr.tokens_per_step, 5 * tr.tokens_per_step]
        assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in recs)
        assert all(g["fused"] for g in tr.optimizer.param_groups)
        assert all(p.dtype == torch.bfloat16 for p in tr.masters.compute)
    finally:
        tr.close()


def test_compile_gives_eager_losses_on_gpu(tmp_path):
    _need_cuda()
    out = {}
    for name, flag in (("eager", "false"), ("compiled", "true")):
        tr = Trainer(compose(GPU + [f"run_dir={tmp_path / name}", "train.steps=3", f"train.compile={flag}"]))
        try:
            out[name] = [tr.train_step()["loss"] for _ in range(3)]
        finally:
            tr.close()
    for a, b in zip(out["compiled"], out["eager"]):
        assert abs(a - b) <= 2e-2 * abs(b), out    # bf16: compiled kernels round differently
