"""The training step on one GPU (skipped without CUDA): no host sync but the one metrics read.

A whole :meth:`Trainer.train_step` (pinned, non-blocking input copies, forward, backward with
the main-gradient hooks, grad norm, clipping, fused AdamW, the router-bias hook, the bf16
refresh, the scheduler) of a tiny bf16 config runs under
``torch.cuda.set_sync_debug_mode("error")``; only :meth:`Trainer._read_metrics` (the step's one
``.tolist()``) runs with the mode off, and it runs exactly once per step, also when
:meth:`Trainer.iter_steps` pipelines the steps. Also on the GPU:
fused AdamW is picked, ``train.compile=true`` gives eager's losses, and ``train.cuda_graph=true``
(:class:`~dropless.train.graph.MicroBatchGraphs`) gives eager's losses and gradient norms with its
steps replayed from graphs.
"""

from __future__ import annotations

import pytest
import torch

from dropless.train.config import compose
from dropless.train.graph import MicroBatchGraphs
from dropless.train.trainer import GRAPH_WARMUP, Trainer

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


def test_micro_batch_graphs_warm_up_capture_and_replay():
    """Eager calls first, then one capture, then replays on new inputs: outputs and the in-place
    gradient accumulation follow every input (the capturing call itself runs once, by its replay)."""
    _need_cuda()
    w = torch.nn.Parameter(torch.randn(8, device="cuda"))
    ran = []

    def fn(x):
        ran.append(1)
        loss = (w * x.float()).square().sum()
        loss.backward()
        return (loss.detach(),)

    g = MicroBatchGraphs(fn, torch.device("cuda"), warmup=2)
    xs = [torch.arange(8).add(i).pin_memory() for i in range(5)]
    for i, x in enumerate(xs):
        (loss,), replayed = g("first", x)
        assert replayed == (i >= 2)
        torch.testing.assert_close(loss, (w.detach() * x.cuda().float()).square().sum())
    assert len(ran) == 3 and g.replays == {"first": 3}
    want = sum(2 * w.detach() * x.cuda().float().square() for x in xs)   # d/dw sum((w x)^2), five times
    torch.testing.assert_close(w.grad, want)
    with pytest.raises(ValueError, match="captured for a"):
        g("first", torch.arange(4))


@pytest.mark.parametrize("extra", [[], ["train.grad_accum=1"], ["train.grad_accum=3"],
                                   ["train.activation_checkpointing=true"], ["train.compile=true"]],
                         ids=["accum2", "accum1", "accum3", "activation_checkpointing", "compile"])
def test_cuda_graph_gives_eager_losses_and_grad_norms(tmp_path, extra):
    """Each kind of micro-batch (the step's first copies into the main gradients, later ones add)
    is captured after GRAPH_WARMUP eager calls and replayed (with grad_accum=3 the later kind is
    captured in the middle of step 2, before the first kind); a validation runs between steps.
    The losses, gradient norms and validation loss equal eager's up to GPU rounding (a replay whose
    main gradients were zeroed, written twice or not accumulated would move the norm far more)."""
    _need_cuda()
    n = GRAPH_WARMUP + 4
    out = {}
    for name, flag in (("eager", "false"), ("graph", "true")):
        tr = Trainer(compose(GPU + [f"run_dir={tmp_path / name}", f"train.steps={n}", f"train.cuda_graph={flag}",
                                    *extra]))
        try:
            recs = list(tr.iter_steps(GRAPH_WARMUP + 2))
            val = tr.validate()                       # eager, eval mode, between two replayed steps
            recs += list(tr.iter_steps(n))
            out[name] = [(r["loss"], r["grad_norm"]) for r in recs] + [(val, 1.0)]
            if flag == "true":
                calls = {"first": n, "rest": n * (tr.accum - 1)}
                assert tr.graphs.replays == {k: c - GRAPH_WARMUP for k, c in calls.items() if c > GRAPH_WARMUP}
        finally:
            tr.close()
    assert len(out["graph"]) == n + 1
    for (la, ga), (lb, gb) in zip(out["graph"], out["eager"]):
        assert abs(la - lb) <= 2e-2 * abs(lb) and abs(ga - gb) <= 5e-2 * abs(gb), out
    assert out["graph"][n - 1][0] < out["graph"][0][0]  # it trains
