"""One run at a time in a run directory (``dropless/train/run_dir.py``): a second run is refused at
start-up, naming the first; the lock ends with its process however it ends; a process's own trainers
share it; every rank of a refused torchrun job stops alike."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dropless.config import ConfigError
from dropless.train import run_dir as rd
from dropless.train.config import compose
from dropless.train.dist import DistEnv
from dropless.train.trainer import Trainer
from tests.dist_harness import run_world

QUICK = ["train.micro_batch_size=4", "train.seq_len=32", "optim.warmup_steps=1", "train.val_every=0",
         "train.ckpt_every=0", "logging.progress=false", "logging.mode=disabled", "num_threads=2"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@contextlib.contextmanager
def held_by_another_process(run: Path):
    """Another process holding ``run``'s lock until the block ends (then it is killed): its Popen."""
    code = ("import sys; from pathlib import Path; from dropless.train.run_dir import lock_run_dir; "
            f"lock_run_dir(Path({str(run)!r})); print('held', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        yield p
    finally:
        p.kill()
        p.wait()


@pytest.fixture
def holder(tmp_path):
    """Another process holding ``tmp_path / "run"``'s lock until it is killed: (run dir, Popen)."""
    run = tmp_path / "run"
    run.mkdir()
    with held_by_another_process(run) as p:
        yield run, p


def test_a_run_dir_held_by_another_process_is_refused_naming_it(holder):
    run, p = holder
    with pytest.raises(ConfigError) as e:
        rd.lock_run_dir(run)
    msg = str(e.value)
    assert "is in use by another run" in msg and f"pid {p.pid}" in msg and "give another run_dir" in msg


def test_a_trainer_on_a_held_run_dir_stops_before_building_the_model(holder, monkeypatch):
    run, p = holder
    import dropless.train.trainer as trainer_mod

    def no_model(*a, **k):
        raise AssertionError("the model was built although the run directory is in use")

    monkeypatch.setattr(trainer_mod, "build_model", no_model)
    for resume in ("false", "true"):  # a new run, and a resume beside the run it would resume
        with pytest.raises(ConfigError, match=f"in use by another run .*pid {p.pid}"):
            Trainer(compose(QUICK + [f"run_dir={run}", f"resume={resume}", "train.steps=2"]))
    assert not (run / "config.yaml").exists() and not (run / "metrics.jsonl").exists()  # nothing overwritten


def test_dropless_train_on_a_held_run_dir_exits_2_with_one_line(holder):
    run, p = holder
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "dropless.train", *QUICK, f"run_dir={run}", "train.steps=2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [line for line in r.stderr.splitlines() if "in use by another run" in line]
    assert len(err) == 1 and f"pid {p.pid}" in err[0]
    assert "Traceback" not in r.stderr


def test_the_lock_ends_with_its_process_however_it_ends(holder):
    run, p = holder
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert (run / rd.LOCK_FILE).exists()  # the file stays; it holds nothing
    lock = rd.lock_run_dir(run)
    try:
        assert f"pid {os.getpid()}" in (run / rd.LOCK_FILE).read_text()  # now names this process
    finally:
        lock.release()


def test_a_process_shares_its_own_lock_and_the_last_release_frees_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    a = rd.lock_run_dir(run)
    b = rd.lock_run_dir(run)  # e.g. a resume beside a trainer not yet closed
    a.release()
    a.release()  # twice: no effect
    probe = [sys.executable, "-c", "from pathlib import Path; from dropless.train.run_dir import lock_run_dir; "
             f"lock_run_dir(Path({str(run)!r}))"]
    r = subprocess.run(probe, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "in use by another run" in r.stderr  # b still holds it
    b.release()
    r = subprocess.run(probe, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_closed_trainer_frees_its_run_dir_and_a_resume_in_another_process_runs(tmp_path):
    run = tmp_path / "run"
    tr = Trainer(compose(QUICK + [f"run_dir={run}", "train.steps=2"]))
    try:
        tr.train()
    finally:
        tr.close()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "dropless.train", *QUICK, f"run_dir={run}", "resume=true",
                        "train.steps=3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_filesystem_without_flock_runs_unlocked_and_says_so(tmp_path, monkeypatch):
    class NoFlock:
        LOCK_EX, LOCK_NB = 2, 4

        @staticmethod
        def flock(fd, op):
            raise OSError(38, "Function not implemented")

    monkeypatch.setattr(rd, "fcntl", NoFlock)
    _, lock = rd.claim_run_dir(tmp_path / "run", DistEnv(0, 1, 0, 1, torch.device("cpu"), 1, 1))
    assert lock.note and "no run-directory lock" in lock.note and "Function not implemented" in lock.note
    lock.release()


def claim_worker(rank, world, run):
    """``claim_run_dir`` on every rank: each rank's ConfigError text, or None."""
    env = DistEnv(rank, world, rank, world, torch.device("cpu"), 1, world)
    try:
        rd.claim_run_dir(Path(run), env)
    except ConfigError as e:
        return str(e)
    return None


def test_every_rank_of_a_job_on_a_held_run_dir_gets_the_same_error(holder):
    run, p = holder
    msgs = run_world("tests.test_run_dir:claim_worker", 2, str(run))
    assert msgs[0] == msgs[1] and msgs[0] is not None and f"pid {p.pid}" in msgs[0]


def test_every_rank_of_a_job_gets_the_error_of_a_run_dir_that_cannot_be_made(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    msgs = run_world("tests.test_run_dir:claim_worker", 2, str(tmp_path / "file" / "run"))
    assert msgs[0] == msgs[1] and msgs[0] is not None and "cannot be created" in msgs[0]


def test_runs_started_in_the_same_second_without_run_dir_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rd.time, "strftime", lambda fmt, *a: "20261206-030000")  # one second for all
    env = DistEnv(0, 1, 0, 1, torch.device("cpu"), 1, 1)
    cfg = compose(QUICK + ["train.steps=1"])
    (tmp_path / "runs" / "20261206-030000").mkdir(parents=True)  # a run of that second, another process's
    got = []
    for _ in range(2):
        path, lock = rd.claim_run_dir(rd.resolve_run_dir(cfg, env), env, fresh=True)
        got.append(path)
        lock.release()
    assert got == [tmp_path / "runs" / f"20261206-030000-{i}" for i in (2, 3)]


def test_a_failed_start_unlocks_and_removes_the_directory_it_made(tmp_path, monkeypatch):
    import dropless.train.trainer as trainer_mod

    def failing_build(*a, **k):
        raise ConfigError("late start-up error")

    monkeypatch.setattr(trainer_mod, "build_model", failing_build)
    new = tmp_path / "new"
    with pytest.raises(ConfigError, match="late start-up error"):
        Trainer(compose(QUICK + [f"run_dir={new}", "train.steps=2"]))
    assert not new.exists()  # made by this start, nothing in it but the lock: gone
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(ConfigError, match="late start-up error"):
        Trainer(compose(QUICK + [f"run_dir={kept}", "train.steps=2"]))
    assert kept.is_dir()  # the user's own directory stays
    assert rd.held_elsewhere(kept) is None and kept.resolve() not in rd._held  # and is free


def test_a_busy_run_dir_with_checkpoints_is_called_in_use_not_resumable(tmp_path):
    run = tmp_path / "run"
    tr = Trainer(compose(QUICK + [f"run_dir={run}", "train.steps=2", "train.ckpt_every=2"]))
    try:
        tr.train()
    finally:
        tr.close()
    with held_by_another_process(run) as p, \
            pytest.raises(ConfigError, match=f"in use by another run .*pid {p.pid}"):  # not "pass resume=true"
        Trainer(compose(QUICK + [f"run_dir={run}", "train.steps=4"]))


def resolve_after_rank0_locked_worker(rank, world, run):
    """Rank 0 has already locked the directory (as its claim_run_dir does while a slower rank is still
    resolving); every rank resolves it."""
    from omegaconf import OmegaConf

    env = DistEnv(rank, world, rank, world, torch.device("cpu"), 1, world)
    if rank == 0:
        rd.lock_run_dir(Path(run))
    torch.distributed.barrier()
    try:
        return str(rd.resolve_run_dir(OmegaConf.create({"run_dir": run, "resume": False}), env))
    except ConfigError as e:
        return f"error: {e}"


def test_a_slower_rank_does_not_mistake_its_own_rank_0_for_another_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    got = run_world("tests.test_run_dir:resolve_after_rank0_locked_worker", 2, str(run))
    assert got == [str(run.resolve())] * 2
