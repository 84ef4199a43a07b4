"""The run directory: which one a run uses (:func:`resolve_run_dir`) and one run at a time in it
(:func:`claim_run_dir`).

Two runs writing one run directory at once (the same ``run_dir=`` typed in two terminals, a job a
scheduler started twice, a ``resume=true`` beside the run it resumes) overwrite each other's
``metrics.jsonl``, ``config.yaml`` and checkpoints, and ``train.ckpt_keep`` deletes the other
run's saves. So rank 0 holds an exclusive lock on ``RUN_DIR/run.lock`` (``fcntl.flock``, advisory,
non-blocking) from the moment it makes the directory until :meth:`Trainer.close
<dropless.train.trainer.Trainer.close>`; a second run is refused at start-up with a
:class:`~dropless.config.ConfigError` naming the holder (its host, pid and start time, read from
the file). The lock belongs to the open file, so the operating system drops it when the holding
process ends, however it ends (kill -9, OOM kill, a node lost): a ``run.lock`` left on disk holds
nothing and is reused. Without ``fcntl`` (not POSIX) or on a filesystem that refuses ``flock``
(some network mounts: ``ENOLCK``/``EOPNOTSUPP``), the run goes on unlocked and says so once.

Within one process the lock is re-entrant: trainers made one after another on the same directory
(tests, ``benchmarks/``: a resume beside a trainer not yet closed) share it, counted, and the last
release unlocks it.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from dropless.config import ConfigError
from dropless.train import checkpoint as ckpt
from dropless.train.dist import DistEnv
from dropless.train.startup import config_changes

try:
    import fcntl
except ImportError:  # not POSIX: no lock (said at start-up)
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = "run.lock"

_held: dict[Path, list] = {}  # run dir -> [open lock file, users in this process]
_held_guard = threading.Lock()


def resolve_run_dir(cfg: DictConfig, env: DistEnv) -> Path:
    """The run directory (of a config that :meth:`~dropless.train.schema.RunConfig.validate` passed: ``resume=true``
    names one), the same on every rank: ``run_dir``, or by default a dated name
    ``runs/YYYYmmdd-HHMMSS`` picked by rank 0 (:func:`claim_run_dir` with ``fresh=True`` then adds
    ``-2``, ``-3``, ... if another run made that directory first). Rank 0 checks a given ``run_dir``
    and broadcasts its verdict, so every rank raises the same error (a rank that looked for itself
    could see the lock its own rank 0 had just taken).

    Raises:
        ConfigError: ``run_dir`` is a file; another run holds
            it (:func:`held_elsewhere`); ``resume=false`` and ``run_dir`` already holds checkpoints
            (a new run would mix with the old one).
    """
    problem, name = None, None
    if env.is_main:
        if cfg.run_dir:
            name = str(Path(str(cfg.run_dir)).expanduser())
            problem = _given_dir_problem(Path(name), bool(cfg.resume))
        else:
            name = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    if env.distributed:
        box = [problem, name]
        dist.broadcast_object_list(box, src=0)
        problem, name = box
    if problem:
        raise ConfigError(problem)
    return Path(name).resolve()


def _given_dir_problem(run_dir: Path, resume: bool) -> str | None:
    """Why a given ``run_dir`` cannot start this run (see :func:`resolve_run_dir`), or None."""
    if run_dir.exists() and not run_dir.is_dir():
        return f"run_dir={str(run_dir)!r} is a file, not a directory; give a directory path"
    holder = held_elsewhere(run_dir)
    if holder:  # before the checkpoint check: "pass resume=true" would be the wrong advice
        return _in_use(run_dir, holder)
    if not resume:
        found = ckpt.latest_checkpoint(run_dir)
        if found is not None:
            return (f"run_dir={str(run_dir)!r} already holds a checkpoint (step {found[0]}): pass resume=true to "
                    "continue it, or give a new run_dir")
    return None


class RunDirLock:
    """Rank 0's hold on a run directory (see the module docstring); :meth:`release` ends it (again: no-op).

    ``note`` is a line to print when no lock could be taken (no ``fcntl``, a filesystem without
    ``flock``), else None. ``made``: this run's start created the directory.
    """

    def __init__(self, run_dir: Path, note: str | None = None, made: bool = False):
        self.run_dir, self.note, self.made, self._held = run_dir, note, made, note is None

    def remove_if_unused(self) -> None:
        """After :meth:`release`, for a start that failed: remove the directory if this start made it,
        it holds nothing but ``run.lock`` and no trainer of this process uses it (a failed start
        leaves no empty ``runs/<date>`` behind)."""
        if not self.made or self._held or self.run_dir in _held:
            return
        try:
            if {p.name for p in self.run_dir.iterdir()} <= {LOCK_FILE}:
                (self.run_dir / LOCK_FILE).unlink(missing_ok=True)
                self.run_dir.rmdir()
        except OSError:
            pass  # someone else's file appeared, or it is gone already: leave it

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        with _held_guard:
            entry = _held.get(self.run_dir)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[self.run_dir]
                entry[0].close()  # closing the file drops its flock


def _no_lock(why: str) -> str:
    """The warning of a run directory that cannot be locked (``why``): runs are not kept apart."""
    return f"no run-directory lock ({why}): two runs given the same run_dir would overwrite each other"


def _in_use(run_dir: Path, holder: str) -> str:
    return (f"run_dir={str(run_dir)!r} is in use by another run ({holder}): two runs in one directory overwrite "
            "each other's checkpoints and metrics; wait for that run to end or stop it, or give another run_dir "
            f"(the lock is {run_dir / LOCK_FILE}: it ends with its process)")


def held_elsewhere(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s lock, if another process does (a probe: a shared ``flock`` taken and
    dropped at once); None when it is free, held by this process, or cannot be probed."""
    path = run_dir / LOCK_FILE
    if fcntl is None or run_dir.resolve() in _held or not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as e:
                return _holder(path) if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    except OSError:
        return None
    return None


def _holder(path: Path) -> str:
    """Who holds ``path`` (its first line: host, pid, start time), or a plain phrase if unreadable."""
    try:
        line = path.read_text().splitlines()[0].strip()
    except (OSError, IndexError, UnicodeDecodeError):
        line = ""
    return line or "a process that has not written its name yet"


def lock_run_dir(run_dir: Path, made: bool = False) -> RunDirLock:
    """Lock an existing ``run_dir`` for this process (re-entrant within it); ``made``: this start
    created it (:meth:`RunDirLock.remove_if_unused`).

    Raises:
        ConfigError: another process holds it.
    """
    run_dir = run_dir.resolve()
    path = run_dir / LOCK_FILE
    with _held_guard:
        entry = _held.get(run_dir)
        if entry is not None:
            entry[1] += 1
            return RunDirLock(run_dir, made=made)
        if fcntl is None:
            return RunDirLock(run_dir, _no_lock("fcntl is not available on this system"), made=made)
        f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 -- held open for the run's life
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(_in_use(run_dir, _holder(path))) from None
            return RunDirLock(run_dir, _no_lock(f"{path}: {e.strerror or e}, e.g. a network filesystem without "
                                                "flock"), made=made)
        f.seek(0)
        f.truncate()
        f.write(f"host {socket.gethostname()}, pid {os.getpid()}, started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
        f.flush()
        _held[run_dir] = [f, 1]
        return RunDirLock(run_dir, made=made)


def _make_fresh(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``, ... : the first that this call creates (atomic ``mkdir``, so
    runs started in the same second, e.g. by a sweep, never share a default directory)."""
    base.parent.mkdir(parents=True, exist_ok=True)
    run_dir, i = base, 1
    while True:
        try:
            run_dir.mkdir()
            return run_dir.resolve()
        except FileExistsError:
            i += 1
            run_dir = base.with_name(f"{base.name}-{i}")


def claim_run_dir(run_dir: Path, env: DistEnv, fresh: bool = False) -> tuple[Path, RunDirLock | None]:
    """Make ``run_dir`` (rank 0), check it is writable and lock it for this run; every rank gets the
    same answer (rank 0 broadcasts it), so a refusal stops all ranks alike instead of leaving the
    others waiting at the next collective. ``fresh``: ``run_dir`` is a default dated name, which
    gets a ``-N`` suffix if it exists (:func:`_make_fresh`). Returns the directory (the same on
    every rank) and rank 0's lock (None on the other ranks).

    Raises:
        ConfigError: the directory cannot be made, is not writable, or another run holds it.
    """
    problem, lock = None, None
    if env.is_main:
        try:
            made = fresh or not run_dir.exists()
            if fresh:
                run_dir = _make_fresh(run_dir)
            else:
                run_dir.mkdir(parents=True, exist_ok=True)
            if not os.access(run_dir, os.W_OK):
                problem = f"run_dir={str(run_dir)!r} is not writable; give a writable directory"
            else:
                lock = lock_run_dir(run_dir, made=made)
        except ConfigError as e:
            problem = str(e)
        except OSError as e:
            problem = f"run_dir={str(run_dir)!r} cannot be created ({e.strerror or e}); give a writable directory"
    if env.distributed:
        box = [problem, str(run_dir)]
        dist.broadcast_object_list(box, src=0)
        problem, run_dir = box[0], Path(box[1])
    if problem:
        if lock is not None:
            lock.release()
        raise ConfigError(problem)
    return run_dir, lock


def save_config(run_dir: Path, cfg: DictConfig, idle: bool = False) -> str | None:
    """Write ``run_dir/config.yaml`` (resolved; rank 0). On a resume (``cfg.resume``) beside a saved one,
    returns the note naming the values that differ from it (else None); ``idle``, a resume with
    nothing left to train, keeps the saved file: it still describes the checkpoints."""
    cfg_file = run_dir / "config.yaml"
    exists = cfg_file.exists()
    note = None
    changed = config_changes(OmegaConf.load(cfg_file), cfg) if cfg.resume and exists else []
    if changed:
        more = f" (and {len(changed) - 8} more)" if len(changed) > 8 else ""
        how = "not saved: nothing is left to train" if idle else "this one is used and saved"
        note = f"[dropless] resume: this config differs from the run's config.yaml ({how}): " + \
            ", ".join(changed[:8]) + more
    if not (idle and exists):
        cfg_file.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return note
