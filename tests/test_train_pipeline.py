"""Pipelined steps (Trainer.iter_steps) on CPU, with CPU's fused AdamW (``optim.fused=true``).

With the update decided on the device (the fused kernel's ``found_inf`` skip and ``grad_scale``
clip), step N's metrics are read after step N+1's forward and backward are launched. Asserted:

* the order: step N's read comes after step N+1's first forward, and before step N+1's update;
* the losses, grad norms, weights and router biases equal the unpipelined steps' bitwise;
* a non-finite step: ``skip`` skips it on the device (masters, moments, biases untouched, as the
  unpipelined run); ``error`` raises naming it, with the weights of the step before, although the
  next step's forward and backward were launched;
* a stop seen at a read drops the step launched behind it (loader rewound, router counts
  discarded): a checkpoint there resumes to the uninterrupted run's losses bitwise; so does a
  caller's ``break`` (closed or not), and an error in the next step's forward still gives the
  applied step's record first.
"""

from __future__ import annotations

import math
import signal

import pytest
import torch

from dropless.train.config import compose
from dropless.train.trainer import NonFiniteError, Trainer
from tests.test_train import QUICK, records
from tests.test_train_robust import _poison_grad, _poison_output, _same, _snapshot

BASE = QUICK + ["logging.mode=disabled", "train.val_every=0", "train.grad_accum=2", "optim.fused=true",
                "train.ckpt_every=0", "optim.grad_clip=0.05"]


def _trainer(tmp_path, *over: str) -> Trainer:
    return Trainer(compose(BASE + [f"run_dir={tmp_path}", *over]))


def _state(tr):
    return [m.clone() for m in tr.masters.masters] + [r.e_score_correction_bias.clone() for r in tr.balancer.routers]


def test_read_of_step_n_comes_after_step_n_plus_1_forward(tmp_path):
    tr = _trainer(tmp_path, "train.steps=4")
    events = []
    plain_read = tr._read_metrics
    tr._read_metrics = lambda p: events.append(("read", p.step)) or plain_read(p)
    tr.model.register_forward_pre_hook(lambda m, a: events.append(("forward", tr.step + 1)))
    plain_update = tr._update
    tr._update = lambda fb: events.append(("update", tr.step + 1)) or plain_update(fb)
    try:
        assert tr.device_guarded
        recs = list(tr.iter_steps(4))
    finally:
        tr.close()
    assert len(recs) == 4 and tr.step == 4
    fwd = [e for e in events if e[0] == "forward"]
    assert len(fwd) == 8                       # 2 micro-batches a step
    order = [e for e in events if e != ("forward", 0)]
    first = {}
    for i, e in enumerate(order):
        first.setdefault(e, i)
    for n in (1, 2, 3):                         # pipelined: read n after n+1's forward, before n+1's update
        assert first[("forward", n + 1)] < first[("read", n)] < first[("update", n + 1)]
    assert first[("update", 4)] < first[("read", 4)]   # the last step is read before iter_steps returns


def test_pipelined_steps_equal_unpipelined_bitwise(tmp_path):
    a, b = _trainer(tmp_path / "a", "train.steps=5"), _trainer(tmp_path / "b", "train.steps=5")
    try:
        ra = list(a.iter_steps(5))
        rb = [b.train_step() for _ in range(5)]
        for x, y in zip(ra, rb):
            assert (x["loss"], x["grad_norm"], x["aux_loss"], x["lr"]) == (y["loss"], y["grad_norm"], y["aux_loss"],
                                                                           y["lr"])
            assert x["grad_norm"] > 0.05                # clipped on the device every step
        assert all(torch.equal(p, q) for p, q in zip(_state(a), _state(b)))
        assert a.loader.state_dict() == b.loader.state_dict()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("poison", [_poison_output, _poison_grad])
def test_pipelined_nonfinite_skip_equals_unpipelined(tmp_path, poison):
    a = _trainer(tmp_path / "a", "train.steps=4", "train.nonfinite=skip")
    b = _trainer(tmp_path / "b", "train.steps=4", "train.nonfinite=skip")
    try:
        ra = [next(a.iter_steps(1))]
        before = _snapshot(a)
        h = poison(a, on_call=2)                     # second micro-batch of step 2
        it = a.iter_steps(4)
        ra.append(next(it))                         # step 2, read after step 3's forward and backward
        h.remove()
        assert ra[1]["skipped_steps"] == 1 and not math.isfinite(ra[1]["grad_norm"])
        ra += list(it)
        assert a.skipped_steps == 1 and [r["skipped_steps"] for r in ra] == [0, 1, 1, 1]
        rb = [b.train_step()]
        h = poison(b, on_call=2)
        rb.append(b.train_step())
        h.remove()
        assert _same(before, _snapshot(b))           # the unpipelined skip left everything as it was
        rb += [b.train_step() for _ in range(2)]
        for x, y in zip(ra, rb):
            assert str(x["loss"]) == str(y["loss"]) and str(x["grad_norm"]) == str(y["grad_norm"])
        assert all(torch.equal(p, q) for p, q in zip(_state(a), _state(b)))
        assert all(torch.isfinite(m).all() for m in a.masters.masters)
    finally:
        a.close()
        b.close()


def test_pipelined_nonfinite_error_names_the_step_with_the_weights_before_it(tmp_path):
    tr = _trainer(tmp_path, "train.steps=4")
    try:
        next(tr.iter_steps(1))
        before = _snapshot(tr)
        _poison_output(tr, on_call=1)
        launched = []
        plain = tr._forward_backward
        tr._forward_backward = lambda: launched.append(tr.step + 1) or plain()
        with pytest.raises(NonFiniteError, match=r"step 2: non-finite training loss \(nan\).*after step 1"):
            list(tr.iter_steps(4))
        assert launched == [2, 3]                   # step 3 was launched behind step 2, never applied
        assert _same(before, _snapshot(tr))
    finally:
        tr.close()


def test_stop_at_a_read_drops_the_launched_step_and_resumes_bitwise(tmp_path):
    ref = _trainer(tmp_path / "ref", "train.steps=5")
    try:
        want = list(ref.iter_steps(5))
    finally:
        ref.close()
    tr = _trainer(tmp_path / "run", "train.steps=5")
    try:
        got = []
        for rec in tr.iter_steps(5):
            got.append(rec)
            if len(got) == 2:
                tr.signals.signum = signal.SIGINT        # Ctrl-C while step 3 is being launched
        assert tr.stopping and len(got) == 3 and tr.step == 3
        assert all(r.tokens_per_expert.abs().sum() == 0 for r in tr.balancer.routers)  # step 4's counts dropped
        tr.save_checkpoint()
    finally:
        tr.close()
    for x, y in zip(got, want):
        assert x["loss"] == y["loss"]
    res = Trainer(compose(BASE + [f"run_dir={tmp_path / 'run'}", "train.steps=5", "resume=true"]))
    try:
        assert res.step == 3
        rest = list(res.iter_steps(5))
    finally:
        res.close()
    assert [r["loss"] for r in rest] == [r["loss"] for r in want[3:]]
    assert [r["grad_norm"] for r in rest] == [r["grad_norm"] for r in want[3:]]


def test_train_logs_every_step_once_in_order_when_pipelined(tmp_path):
    tr = Trainer(compose(BASE + [f"run_dir={tmp_path}", "train.steps=6", "train.val_every=3", "train.ckpt_every=4"]))
    try:
        summary = tr.train()
    finally:
        tr.close()
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4, 5, 6] and summary["steps"] == 6
    assert "val_loss" in recs[3] and "val_loss" in recs[6]
    from dropless.train.checkpoint import latest_checkpoint
    assert latest_checkpoint(tmp_path)[0] == 6
    assert (tmp_path / "checkpoints" / "step_00000004").is_dir()


@pytest.mark.parametrize("close", [True, False])
def test_leaving_early_drops_the_launched_step(tmp_path, close):
    ref = _trainer(tmp_path / "ref", "train.steps=6")
    try:
        want = [r["loss"] for r in ref.iter_steps(6)]
    finally:
        ref.close()
    tr = _trainer(tmp_path / "run", "train.steps=6")
    try:
        it = tr.iter_steps(6)
        got = [next(it)["loss"] for _ in range(3)]   # step 4 is launched behind step 3's record
        if close:
            it.close()
        else:
            keep = it  # noqa: F841  (still referenced: the next iter_steps drops the launched step)
        assert tr.step == 3
        got += [r["loss"] for r in tr.iter_steps(6)]
        assert got == want
    finally:
        tr.close()


def test_an_error_in_the_next_forward_still_yields_the_applied_step(tmp_path):
    tr = _trainer(tmp_path, "train.steps=5")
    calls = []
    plain = tr._loss

    def loss(x, y):
        calls.append(1)
        if len(calls) == 5:                          # step 3's first micro-batch
            raise RuntimeError("boom")
        return plain(x, y)
    tr._loss = loss
    try:
        recs = []
        with pytest.raises(RuntimeError, match="boom"):
            for r in tr.iter_steps(5):
                recs.append(r)
        assert [r["tokens"] // tr.tokens_per_step for r in recs] == [1, 2] and tr.step == 2
    finally:
        tr.close()


def test_an_interrupt_during_the_last_step_completes_the_run(tmp_path, capsys):
    """A Ctrl-C that lands in the last step stopped the run as "interrupted" (exit 130, "continue with
    resume=true") although train.steps was reached; the run now completes as usual."""
    tr = Trainer(compose(BASE + [f"run_dir={tmp_path}", "train.steps=3", "train.val_every=0"]))
    try:
        plain = tr._update

        def update(launched):
            out = plain(launched)
            if tr.step == 3:
                tr.signals.signum = signal.SIGINT  # Ctrl-C during the last step's update, before its read
            return out

        tr._update = update
        summary = tr.train()
    finally:
        tr.close()
    assert summary["steps"] == 3 and not summary["interrupted"]
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "interrupted" in line]
    assert len(said) == 1 and "train.steps=3" in said[0] and "[dropless] done: 3 steps" in out, said
    from dropless.train.checkpoint import latest_checkpoint
    assert latest_checkpoint(tmp_path)[0] == 3
