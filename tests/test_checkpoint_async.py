"""``train.ckpt_async``: periodic checkpoints written in the background with DCP's ``async_save``.

* A save asked at step k holds step k's weights and AdamW state bitwise, although training goes
  on (and changes them) before the background write starts; until it is finished it is neither
  listed, loaded nor pruned.
* The save at the end and the one on SIGTERM are complete when ``train()`` returns, the save in
  flight before them too.
* A failed background write is raised on the main thread at the next save (or the last one),
  as a ``SaveError`` naming the checkpoint; nothing incomplete is ever listed.
* Resuming from an asynchronous checkpoint gives the losses of resuming from a synchronous one
  (bitwise on CPU), in one process and on two gloo ranks with expert parallelism (the experts
  saved as DTensors).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from dropless.train import checkpoint as ckpt
from dropless.train.config import compose
from dropless.train.state import ModelState, OptimizerState
from dropless.train.trainer import Trainer
from tests import dist_harness as H
from tests.test_train import QUICK, _env, records

COMMON = ["train.val_every=0", "train.ckpt_keep=0", "logging.mode=disabled", "optim.warmup_steps=0"]
_write = dcp.FileSystemWriter.write_data


def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpointed state (weights, AdamW moments and steps), cloned, by name."""
    msd, osd = get_state_dict(model, optimizer)
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        out.update({f"optim.{fqn}.{n}": v.detach().clone() for n, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]


@pytest.fixture
def held_writes(monkeypatch):
    """DCP's file writes wait until the event is set (the training goes on meanwhile)."""
    go = threading.Event()

    def write_data(self, plan, planner):
        assert go.wait(60), "the test never released the write"
        return _write(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_data)
    return go


@pytest.fixture(params=["default", "refill", pytest.param("cuda", marks=pytest.mark.gpu)])
def stager(request, monkeypatch):
    """The asynchronous saves' stager: DCP's default (a new copy per save, the CPU's), the one kept
    and refilled between saves (CUDA's, :func:`ckpt.host_stager`; pinning is a no-op here, a CPU
    build cannot pin), or on a GPU the trainer's own (pinned, on a CUDA run)."""
    if request.param == "default":
        return None
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs CUDA: the trainer's own pinned stager")
        s = ckpt.host_stager(torch.device("cuda"))
        s.run_overrides = ["device=cuda"]  # a CUDA run (the other stagers run on the CPU, as QUICK says)
        return s
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    return ckpt._RefillStager()


def test_async_save_holds_its_step_while_training_goes_on(tmp_path, held_writes, stager):
    tr = Trainer(compose(QUICK + COMMON + [f"run_dir={tmp_path}", "train.steps=6", "train.ckpt_async=true",
                              *getattr(stager, "run_overrides", [])]))
    tr.checkpoints.stager = stager
    try:
        for _ in range(2):
            tr.train_step()
        at2 = _snapshot(tr.masters.state_module, tr.optimizer)
        path = tr.save_checkpoint(wait=False)
        assert path == ckpt.checkpoint_dir(tmp_path, 2) and tr.checkpoints.pending is not None
        partial = path.with_name(path.name + ".partial")
        for _ in range(2):  # the write has not started: the state it holds was copied at step 2
            tr.train_step()
        assert any(not torch.equal(v, at2[k]) for k, v in _snapshot(tr.masters.state_module, tr.optimizer).items())
        assert ckpt.latest_checkpoint(tmp_path) is None and ckpt.incomplete_checkpoints(tmp_path) == []
        ckpt.prune(tmp_path, 1)  # never deletes the save in flight
        assert partial.is_dir()
        held_writes.set()
        assert tr.checkpoints.finish() == path
        assert ckpt.latest_checkpoint(tmp_path) == (2, path) and not partial.exists()
        tr.checkpoints.load(path)
        assert tr.step == 2
        _assert_equal(_snapshot(tr.masters.state_module, tr.optimizer), at2)
    finally:
        held_writes.set()
        tr.close()


def test_consecutive_async_saves_each_hold_their_step(tmp_path, held_writes, capsys, stager):
    """Two background saves in a row: the save at step 4 (which first finishes step 2's) must not
    change what step 2's checkpoint holds, and step 4's holds step 4's state although training
    goes on while it is written. The second save says it waited for the first one's write. With
    the refilled stager both saves go through the same host copy."""
    tr = Trainer(compose(QUICK + COMMON + [f"run_dir={tmp_path}", "train.steps=8", "train.ckpt_async=true",
                              *getattr(stager, "run_overrides", [])]))
    tr.checkpoints.stager = stager
    try:
        snaps = {}
        for step in (2, 4):
            while tr.step < step:
                tr.train_step()
            snaps[step] = _snapshot(tr.masters.state_module, tr.optimizer)
            if step == 4:  # step 2's write was held while steps 3 and 4 trained; let it go from here
                threading.Timer(1.5, held_writes.set).start()
            tr.save_checkpoint(wait=False)  # step 4's first finishes step 2's
            waited = tr.checkpoints.waited
            assert (waited is None) if step == 2 else (waited[0].name == "step_00000002" and waited[1] >= 1.4)
        out = capsys.readouterr().out
        assert "checkpoint step_00000004: waited" in out and "for step_00000002's background write to finish" in out
        assert "checkpoint step_00000002: waited" not in out
        tr.train_step()
        tr.checkpoints.finish()
        if stager is not None:  # one host copy, refilled: its tensors hold step 4's values now
            staged = stager.state_dict_cache["model"]
            assert all(torch.equal(staged[k[len("model."):]], v.cpu()) for k, v in snaps[4].items()
                       if k.startswith("model."))
            tr.close()
            assert tr.checkpoints.stager is None  # the closed trainer lets its host copy go
        for step in (2, 4):
            tr.checkpoints.load(ckpt.checkpoint_dir(tmp_path, step))
            assert tr.step == step
            _assert_equal(_snapshot(tr.masters.state_module, tr.optimizer), snaps[step])
    finally:
        held_writes.set()
        tr.close()


def test_last_save_says_how_long_it_waited_for_the_background_write(tmp_path, held_writes, capsys):
    """The save at the end (synchronous) first completes the background one: a wait that long is
    said (it is part of that save's pause), without the periodic saves' advice."""
    tr = Trainer(compose(QUICK + COMMON + [f"run_dir={tmp_path}", "train.steps=4", "train.ckpt_async=true"]))
    try:
        tr.train_step()
        tr.save_checkpoint(wait=False)
        tr.train_step()
        threading.Timer(1.5, held_writes.set).start()
        tr.save_checkpoint(wait=True)
        out = capsys.readouterr().out
        assert "checkpoint step_00000002: waited " in out
        assert "for step_00000001's background write to finish first" in out and "raise train.ckpt_every" not in out
        assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2]
    finally:
        held_writes.set()
        tr.close()


def test_refill_stager_keeps_its_copy_and_remakes_it_when_the_state_changes_shape(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    st = ckpt._RefillStager()
    a = {"w": torch.ones(3), "step": 1}
    first = st.stage(a)
    a["w"].add_(1)
    second = st.stage({"w": a["w"], "step": 2})
    assert second["w"] is first["w"] and second["w"].data_ptr() != a["w"].data_ptr()
    assert torch.equal(second["w"], torch.full((3,), 2.0)) and second["step"] == 2
    third = st.stage({"w": a["w"], "m": torch.zeros(2), "step": 3})  # an AdamW state that appeared
    assert third["w"] is not first["w"] and torch.equal(third["w"], a["w"]) and torch.equal(third["m"], torch.zeros(2))
    assert ckpt.host_stager(torch.device("cpu")) is None


def test_refill_stager_without_pinned_memory_says_so_and_copies_each_save(monkeypatch, caplog):
    def refuse(self, *a, **k):
        raise RuntimeError("CUDA error: out of memory (injected: page-locked memory refused)")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    st = ckpt._RefillStager()
    w = torch.ones(3)
    with caplog.at_level("WARNING", logger=ckpt.__name__):
        first = st.stage({"w": w})
    assert "could not make a pinned host copy" in caplog.text and "page-locked memory refused" in caplog.text
    w.add_(1)
    second = st.stage({"w": w})
    assert second["w"] is not first["w"] and torch.equal(first["w"], torch.ones(3)) and torch.equal(second["w"], w)
    assert caplog.text.count("could not make a pinned host copy") == 1


def _run(rd: Path, *over: str) -> tuple[dict, Trainer]:
    tr = Trainer(compose(QUICK + COMMON + [f"run_dir={rd}", *over]))
    try:
        return tr.train(), tr
    finally:
        tr.close()


def _losses(rd: Path) -> dict[int, tuple]:
    return {r["step"]: (r["loss"], r["grad_norm"], r["aux_loss"]) for r in records(rd) if r["step"] > 0}


def _names(rd: Path) -> list[str]:
    return sorted(p.name for p in (rd / "checkpoints").iterdir())


def test_resume_from_an_async_checkpoint_equals_resume_from_a_sync_one(tmp_path):
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    _run(sync, "train.steps=6", "train.ckpt_every=3")
    summary, tr = _run(asyn, "train.steps=6", "train.ckpt_every=3", "train.ckpt_async=true")
    assert tr.checkpoints.pending is None and summary["steps"] == 6
    assert _names(asyn) == ["step_00000003", "step_00000006"]  # the last one is complete at return
    assert _losses(asyn) == _losses(sync)  # saving in the background does not change training
    got = {}
    for name, src in (("from_sync", sync), ("from_async", asyn)):
        rd = tmp_path / name
        (rd / "checkpoints").mkdir(parents=True)
        shutil.copytree(src / "checkpoints" / "step_00000003", rd / "checkpoints" / "step_00000003")
        _, tr = _run(rd, "train.steps=6", "resume=true")
        assert tr.resumed_from == 3
        got[name] = _losses(rd)
    assert sorted(got["from_async"]) == [4, 5, 6]
    assert got["from_async"] == got["from_sync"]  # bitwise


def test_sigterm_saves_a_complete_checkpoint_after_the_one_in_flight(tmp_path, monkeypatch):
    def slow_write(self, plan, planner):
        time.sleep(0.3)  # still in flight when the signal's save comes
        return _write(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", slow_write)
    tr = Trainer(compose(QUICK + COMMON + [f"run_dir={tmp_path}", "train.steps=50", "train.ckpt_every=2",
                                           "train.ckpt_async=true"]))
    log = tr.metrics.log

    def log_and_signal(step, rec, **kw):  # SIGTERM during step 4's periodic save's write
        log(step, rec, **kw)
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    tr.metrics.log = log_and_signal
    try:
        summary = tr.train()
    finally:
        tr.close()
    assert summary["interrupted"] and summary["steps"] == 5
    assert tr.checkpoints.pending is None
    assert _names(tmp_path) == ["step_00000002", "step_00000004", "step_00000005"]
    assert all(ckpt.is_complete(p) for _, p in ckpt.list_checkpoints(tmp_path))


@pytest.mark.parametrize("steps", [3, 6], ids=["raised_by_the_last_save", "raised_by_the_next_save"])
def test_a_failed_background_write_is_raised_at_the_next_save(tmp_path, monkeypatch, steps):
    def failing_write(self, plan, planner):
        if "step_00000002" in str(self.path):
            raise OSError(28, "No space left on device (injected)")
        return _write(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", failing_write)
    tr = Trainer(compose(QUICK + COMMON + [f"run_dir={tmp_path}", f"train.steps={steps}", "train.ckpt_every=2",
                                           "train.ckpt_async=true"]))
    try:
        with pytest.raises(ckpt.SaveError, match=r"step_00000002: the asynchronous save of step 2 failed "
                                                 r"\(rank 0: OSError: .*injected\)"):
            tr.train()
        assert tr.step == min(steps, 4)  # trained on until the next save
    finally:
        tr.close()
    assert ckpt.latest_checkpoint(tmp_path) is None  # nothing after it was started either
    assert (tmp_path / "checkpoints" / "step_00000002.partial").is_dir()


# ------------------------------------------------------------------------------ two gloo ranks
def async_worker(rank, world, out_dir, fail_rank, refill=False):
    """EP over 2 ranks: a dense weight and this rank's half of an expert weight, AdamW. Save async at
    step 1, take a step more (changing everything), then finish, load and compare with step 1.
    ``refill``: through the stager CUDA runs use (its kept copy refilled: pinning a no-op here), with
    a second save at step 2 through the same copy (the experts as DTensors), compared as well."""
    from dropless.dispatch.mesh import build_mesh
    from dropless.train.dist import DistEnv

    env = DistEnv(rank, world, rank, world, torch.device("cpu"), ep_size=world, dp_size=1)
    env.mesh = build_mesh(world, world, "cpu")
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.dense = torch.nn.Linear(4, 4)
    model.experts = torch.nn.Parameter(torch.randn(2, 3) + rank)  # rank r's experts 2r, 2r + 1 of 4
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()

    go = threading.Event()

    def write_data(self, plan, planner):
        assert go.wait(60)
        if rank == fail_rank:
            raise OSError(28, "No space left on device (injected)")
        return _write(self, plan, planner)

    dcp.FileSystemWriter.write_data = write_data
    if refill:
        torch.Tensor.pin_memory = lambda self, *a, **k: self
    app_state = {"model": ModelState(model, {"experts"}, env.mesh),
                 "optim": OptimizerState(model, opt, {"experts"}, env.mesh), "trainer": {"step": 0}}
    saver = ckpt.Checkpointer(out_dir, env, app_state, asynchronous=True, timeout_s=60,
                              stager=ckpt._RefillStager() if refill else None)
    step()
    at1 = _snapshot(model, opt)
    app_state["trainer"] = {"step": 1}
    saver.save(1, wait=False)
    step()
    go.set()
    at2 = _snapshot(model, opt)
    if refill:  # completes step 1's write, then refills the same host copy with step 2's state
        app_state["trainer"] = {"step": 2}
        saver.save(2, wait=False)
        step()
    try:
        saver.finish()
    except ckpt.SaveError as e:
        return {"error": str(e)}
    dcp.FileSystemWriter.write_data = _write
    out = {}
    for k, want in [(1, at1)] + ([(2, at2)] if refill else []):
        saver.load(ckpt.checkpoint_dir(out_dir, k))
        now = _snapshot(model, opt)
        equal = sorted(n for n in want if torch.equal(want[n], now[n]))
        out[k] = {"step": app_state["trainer"]["step"], "equal": equal}
    return {**out[1], "keys": sorted(at1), "step2": out.get(2)}


@pytest.mark.slow
def test_two_ranks_async_save_holds_its_step_and_a_rank_failure_reaches_both(tmp_path):
    ok = H.run_world("tests.test_checkpoint_async:async_worker", 2, str(tmp_path / "ok"), -1)
    for r in ok:
        assert r["step"] == 1 and r["equal"] == r["keys"] and "optim.experts.exp_avg" in r["keys"], r
    assert ckpt.latest_checkpoint(tmp_path / "ok")[0] == 1
    bad = H.run_world("tests.test_checkpoint_async:async_worker", 2, str(tmp_path / "bad"), 1)
    for r in bad:  # rank 1's write failed; both ranks raise, naming the checkpoint and rank 1's error
        assert "step_00000001: the asynchronous save of step 1 failed (rank 1: OSError" in r["error"], r
        assert "injected" in r["error"]
    assert ckpt.latest_checkpoint(tmp_path / "bad") is None


@pytest.mark.slow
def test_two_ranks_async_saves_through_the_kept_host_copy(tmp_path):
    """The stager CUDA runs get (one host copy, refilled at each save) with expert-parallel DTensors:
    steps 1 and 2, saved through the same copy, each load back as they were."""
    for r in H.run_world("tests.test_checkpoint_async:async_worker", 2, str(tmp_path), -1, True):
        assert r["step"] == 1 and r["equal"] == r["keys"], r
        assert r["step2"]["step"] == 2 and r["step2"]["equal"] == r["keys"], r
    assert ckpt.latest_checkpoint(tmp_path)[0] == 2


@pytest.mark.slow
def test_torchrun_two_ranks_resume_from_an_async_ep_checkpoint(tmp_path):
    """2 ranks (gloo), a2a (the experts saved as DTensors): the run with background saves resumes from
    its step-2 checkpoint with the losses it had."""
    a, b = tmp_path / "a", tmp_path / "b"
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "dropless.train", *QUICK, "num_threads=1", "dispatcher=a2a", "train.steps=4",
            "train.ckpt_every=2", "train.ckpt_async=true", *COMMON]
    r = subprocess.run([*base, f"run_dir={a}"], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checkpoint step_00000002: training paused" in r.stdout
    assert _names(a) == ["step_00000002", "step_00000004"]
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "step_00000002", b / "checkpoints" / "step_00000002")
    r = subprocess.run([*base, f"run_dir={b}", "resume=true"], capture_output=True, text=True, env=_env(),
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got, want = _losses(b), _losses(a)
    assert sorted(got) == [3, 4] and all(got[s] == want[s] for s in got)  # bitwise
