"""Faults of a training job on 2 gloo ranks under torchrun (CPU): a stalled rank, a killed rank.

* A rank that stops taking part (sleeps forever before step 2): the other rank exits with
  status 1 and an error naming ``train.dist_timeout_s``, within that timeout plus a few
  seconds of the stall (issue 11 item 9).
* The same through the expert-parallel group: 4 ranks, ``dispatcher=a2a`` with EP = 2
  (mesh dp 2 × ep 2); ranks 1-3 stall before step 2, so rank 0's first collective after the
  stall is the a2a dispatcher's all-to-all with rank 1 over the ep group ``[0, 1]``, a group
  of the mesh (not the world group): rank 0 must fail within ``train.dist_timeout_s`` too,
  not after torch's 30-minute default for new groups.
* A rank SIGKILLed mid-run under ``torchrun --max-restarts 1``: torchrun restarts both, they
  resume by themselves (``TORCHELASTIC_RESTART_COUNT`` > 0 means ``resume=true``) from the
  newest complete checkpoint and finish; every step's loss and grad norm equals the
  uninterrupted run's, bitwise (issue 11 item 6).
* A rank SIGKILLed inside the checkpoint save of step 4 (after its DCP files, before the save
  completes): the half-written checkpoint is never loaded (the restart resumes from step 2,
  logs that it ignores step 4's directory) and the losses again equal the uninterrupted run's.

The faults are injected by ``tests/fault_rank.py``. Runtime ≈ 90-150 s on 2 busy cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_train import QUICK, _env, records

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
FAULT_RANK = str(ROOT / "tests" / "fault_rank.py")
BASE = QUICK + ["num_threads=1", "train.val_every=0", "logging.mode=disabled"]
STEPS = 10


def _torchrun(run_dir: Path, extra: list[str], *, restarts: int = 0, fault: dict | None = None,
              log: Path | None = None, nproc: int = 2) -> subprocess.Popen:
    env = _env()
    env["FAULT_PID_DIR"] = str(_pid_dir(run_dir))
    env.update(fault or {})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max-restarts", str(restarts), "--monitor-interval", "0.2", FAULT_RANK,
           *BASE, f"run_dir={run_dir}", *extra]
    out = open(log or run_dir.with_suffix(".log"), "w")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                            start_new_session=True)


def _pid_dir(run_dir: Path) -> Path:
    d = run_dir.with_name(run_dir.name + ".pids")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _finish(p: subprocess.Popen, timeout: float, run_dir: Path) -> int | None:
    """torchrun's exit status, or None if it had to be killed after ``timeout`` s. Either way no
    worker outlives the test: torchrun detaches them (setsid), so each worker that
    wrote its pid (tests/fault_rank.py) and still runs is killed by that pid."""
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return None
    finally:
        for f in _pid_dir(run_dir).iterdir():
            pid = int(f.read_text())
            try:
                if "fault_rank.py" in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                pass


def _losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    """Step -> (loss, grad_norm), the last record of each step (a restart logs some steps again)."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    rd = tmp_path_factory.mktemp("ref") / "run"
    p = _torchrun(rd, [f"train.steps={STEPS}", "train.ckpt_every=2", "train.ckpt_keep=0"])
    assert _finish(p, 300, rd) == 0, rd.with_suffix(".log").read_text()[-3000:]
    got = _losses(rd)
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


def test_stalled_rank_fails_the_other_within_the_timeout(tmp_path):
    timeout_s = 4
    rd, mark = tmp_path / "run", tmp_path / "stalled_at"
    pids = _pid_dir(rd)
    p = _torchrun(rd, ["train.steps=50", "train.ckpt_every=0", f"train.dist_timeout_s={timeout_s}"],
                  fault={"FAULT": "stall", "FAULT_STEP": "2", "FAULT_RANK": "1", "FAULT_MARK": str(mark)})
    try:
        deadline = time.monotonic() + 240
        while not mark.exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        assert mark.exists(), rd.with_suffix(".log").read_text()[-3000:]
        rank0 = int((pids / "rank0.start0").read_text())
        while _alive(rank0) and time.monotonic() < deadline:
            time.sleep(0.1)
        exited = time.time()
        stalled = float(mark.read_text())
    finally:
        _finish(p, 0.1, rd)
    log = rd.with_suffix(".log").read_text()
    assert "train.dist_timeout_s=4" in log and "a peer rank died or stopped taking part" in log, log[-3000:]
    assert "rank 0 of 2" in log, log[-3000:]
    waited = exited - stalled
    assert timeout_s * 0.8 <= waited < timeout_s + 8, (waited, log[-2000:])


def test_stalled_ep_peer_fails_the_other_within_the_timeout(tmp_path):
    timeout_s = 4
    rd, mark = tmp_path / "run", tmp_path / "stalled_at"
    pids = _pid_dir(rd)
    p = _torchrun(rd, ["train.steps=50", "train.ckpt_every=0", f"train.dist_timeout_s={timeout_s}",
                       "dispatcher=a2a", "dispatcher.ep_size=2"], nproc=4,
                  fault={"FAULT": "stall", "FAULT_STEP": "2", "FAULT_RANK": "1,2,3", "FAULT_MARK": str(mark)})
    try:
        deadline = time.monotonic() + 300
        while not mark.exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
        assert mark.exists(), rd.with_suffix(".log").read_text()[-3000:]
        rank0 = int((pids / "rank0.start0").read_text())
        # bounded: on a mesh whose ep group has torch's default timeout, rank 0 would wait 30 min
        deadline = time.monotonic() + timeout_s + 40
        while _alive(rank0) and time.monotonic() < deadline:
            time.sleep(0.1)
        hung = _alive(rank0)
        exited = time.time()
        stalled = float(mark.read_text())
    finally:
        _finish(p, 0.1, rd)
    log = rd.with_suffix(".log").read_text()
    assert not hung, f"rank 0 still waits {exited - stalled:.0f} s after its ep peer stalled: " + log[-3000:]
    assert "train.dist_timeout_s=4" in log and "a peer rank died or stopped taking part" in log, log[-3000:]
    assert "rank 0 of 4" in log and "a2a dispatcher" in log, log[-3000:]
    waited = exited - stalled
    assert timeout_s * 0.8 <= waited < timeout_s + 8, (waited, log[-2000:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def test_killed_rank_restarts_and_continues_bitwise(tmp_path, reference):
    rd = tmp_path / "run"
    pids = _pid_dir(rd)
    p = _torchrun(rd, [f"train.steps={STEPS}", "train.ckpt_every=2", "train.ckpt_keep=0"], restarts=1)
    killed_after = 5
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:
        if (rd / "metrics.jsonl").exists() and any(r.get("step", 0) >= killed_after and "loss" in r
                                                   for r in records(rd)):
            break
        time.sleep(0.05)
    os.kill(int((pids / "rank1.start0").read_text()), signal.SIGKILL)
    assert _finish(p, 300, rd) == 0, rd.with_suffix(".log").read_text()[-3000:]
    log = rd.with_suffix(".log").read_text()
    assert "torchrun restart 1: resuming" in log and (pids / "rank1.start1").exists(), log[-3000:]
    assert _losses(rd) == reference


def test_rank_killed_during_a_save_never_loads_the_half_written_checkpoint(tmp_path, reference):
    rd = tmp_path / "run"
    p = _torchrun(rd, [f"train.steps={STEPS}", "train.ckpt_every=2", "train.ckpt_keep=0"], restarts=1,
                  fault={"FAULT": "kill_in_save", "FAULT_STEP": "4", "FAULT_RANK": "1"})
    assert _finish(p, 300, rd) == 0, rd.with_suffix(".log").read_text()[-3000:]
    log = rd.with_suffix(".log").read_text()
    assert "torchrun restart 1: resuming" in log, log[-3000:]
    assert "resumed from step 2" in log, log[-3000:]   # not from the half-written step 4
    assert "step_00000004.partial: its save did not finish" in log, log[-3000:]
    assert _losses(rd) == reference
    ckpts = sorted(d.name for d in (rd / "checkpoints").iterdir())
    assert ckpts == [f"step_{s:08d}" for s in range(2, STEPS + 1, 2)], ckpts  # the leftover was pruned
