"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): model, optimizer, step, data, RNG; when to save.

Layout: ``<run_dir>/checkpoints/step_00000300/`` is one DCP checkpoint (``.metadata`` plus
``__<rank>_<i>.distcp`` files, one per writing thread of each rank: ``train.ckpt_threads``, DCP's
``FileSystemWriter(thread_count=...)``) and its completion marker ``COMPLETE``.

Atomic (a rank killed mid-save never leaves a checkpoint that loads): every rank writes into
``step_00000300.partial/``; after all ranks' files and DCP's ``.metadata`` are written, rank 0
writes ``COMPLETE`` and renames the directory to ``step_00000300``. Only a directory of that
name holding the marker is listed, loaded or resumed from; ``*.partial`` leftovers and
directories without the marker are ignored with a log line, and :func:`prune` deletes them.

State saved: an ``app_state`` dict of :class:`~torch.distributed.checkpoint.stateful.Stateful`
parts, each saving and restoring itself (a save hands them to DCP, which calls their ``state_dict``;
:func:`load` has DCP fill their state dicts and calls their ``load_state_dict``, as ``dcp.load``
does; every rank calls both collectively). A run's entries (the trainer's ``app_state``), whose names
are the checkpoint's top-level keys, with the keys inside each entry that every checkpoint of a run
has held:

* ``model``: :class:`dropless.train.state.ModelState`, the weights and buffers (router biases
  included), experts under expert parallelism as one global ``[E, ...]`` tensor each;
* ``optim``: :class:`dropless.train.state.OptimizerState`, AdamW's moments and steps (experts likewise);
* ``trainer``: :class:`dropless.train.progress.Progress`, ``step`` (optimizer steps done), the data
  loader's position, the LR schedule's step and ``skipped_steps`` (the same on every rank);
* ``rng``: :class:`dropless.train.state.RngState`, ``rank{r}`` -> that rank's torch CPU (and CUDA)
  generator state.

When to save (:meth:`Checkpointer.step_end`, asked once after every optimizer step): every
``train.ckpt_every`` steps (in the background with ``train.ckpt_async``), at the last step, and on a
stop request (SIGINT/SIGTERM); the last two are complete when it returns.

Asynchronous saves (:class:`Checkpointer` with ``asynchronous=True``, ``train.ckpt_async``):
:func:`start_save` copies the state to host memory (DCP's ``async_save`` stages it before it
returns, so the checkpoint holds the values of the step it was asked at, whatever training
does next) and writes ``step_X.partial/`` in a background thread; :func:`finish_save`, run
on the main thread, waits for every rank's write and only then writes ``COMPLETE`` and
renames, exactly as a synchronous save does. A save in flight is never listed, loaded or
deleted by :func:`prune` in this process. With several ranks the background writes talk over
a gloo group of their own (async_save needs a CPU backend; the training collectives keep
theirs). Cost: a host copy of this rank's whole saved state. On CUDA it is pinned, made at the
first save and refilled by each later one (:func:`host_stager`: torch's ``BlockingAsyncStager``
with its cache), so it stays allocated for the run and a save after the first is a device-to-host
copy at the link's speed; elsewhere the writer stages (DCP's choice when no stager is given): a new
pageable copy at every save.

Errors: :class:`FileNotFoundError` for a checkpoint directory without its completion marker;
:class:`SaveError` for a save whose write failed on any rank (an asynchronous one at
:func:`finish_save`), naming the checkpoint.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager
from torch.distributed.checkpoint.stateful import Stateful

from dropless.config import ConfigError

__all__ = ["MARKER", "Checkpointer", "PendingSave", "SaveError", "SaveNote", "checkpoint_dir", "finish_save",
           "host_stager", "saved_world_size", "world_size_note",
           "incomplete_checkpoints", "is_complete", "latest_checkpoint", "list_checkpoints", "load", "prune", "save",
           "start_save"]

_STEP_RE = re.compile(r"^step_(\d+)$")
_PARTIAL = ".partial"
#: written last, by rank 0, once every rank's part of the checkpoint is on disk; it holds
#: ``step N`` and ``world_size W`` lines (:func:`saved_world_size`)
MARKER = "COMPLETE"
_log = logging.getLogger(__name__)
#: ``.partial`` directories of the asynchronous saves in flight in this process: never listed as
#: leftovers, never pruned
_writing: set[Path] = set()


class SaveError(RuntimeError):
    """A checkpoint save failed (its write, on one rank or more); the message names the checkpoint.

    The checkpoint is not complete: its ``.partial`` directory is never loaded.
    """


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """``<run_dir>/checkpoints/step_XXXXXXXX`` (8 digits) for optimizer step ``step``."""
    return Path(run_dir) / "checkpoints" / f"step_{int(step):08d}"


def is_complete(path: Path) -> bool:
    """True if ``path`` is a finished checkpoint: its save reached the completion marker."""
    return (Path(path) / MARKER).is_file() and (Path(path) / ".metadata").is_file()


def incomplete_checkpoints(run_dir: Path) -> list[Path]:
    """Directories under ``<run_dir>/checkpoints`` left by a save that did not finish (never loaded);
    an asynchronous save of this process still in flight is not one."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.resolve() not in _writing and (
        p.name.endswith(_PARTIAL) or (_STEP_RE.match(p.name) and not is_complete(p))))


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``run_dir`` as ``(step, path)``, oldest first.

    A directory that an interrupted save left (see the module docstring) is not listed; each is
    logged once per call (``logging`` warning) so a skipped save is visible.
    """
    root = Path(run_dir) / "checkpoints"
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and is_complete(p):
                out.append((int(m.group(1)), p))
    for p in incomplete_checkpoints(run_dir):
        _log.warning("ignoring %s: its save did not finish (no %s marker); it is never loaded", p, MARKER)
    return sorted(out)


def saved_world_size(path: Path) -> int | None:
    """How many ranks saved the checkpoint at ``path`` (its marker's ``world_size`` line), or None where
    the marker does not say (a marker written before that line existed, or none)."""
    try:
        for line in (Path(path) / MARKER).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "world_size" and value.strip().isdigit():
                return int(value)
    except OSError:
        return None
    return None


def world_size_note(path: Path, world_size: int) -> str | None:
    """A warning when the checkpoint at ``path`` was saved by another number of ranks than ``world_size``
    (:func:`saved_world_size`): it loads, but the data position no longer continues the run's. Else None."""
    saved = saved_world_size(path)
    if saved is None or saved == world_size:
        return None
    return (f"resume: {Path(path).name} was saved by {saved} rank(s), this run has {world_size}: the weights and "
            "optimizer state carry over, but each rank's shard of the training windows changes with the rank "
            "count, so the rest of this data epoch is not the uninterrupted run's (some windows seen again, some "
            "left to the next epoch), and the tokens per step scale with the ranks (the learning-rate schedule "
            "counts optimizer steps)")


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint ``(step, path)`` in ``run_dir``, or None."""
    ck = list_checkpoints(run_dir)
    return ck[-1] if ck else None


#: DCP's note that it saves or loads in one process (no process group), which a one-process run silences
_SINGLE_PROCESS_NOTE = r"torch\.distributed is .*, assuming the intent is to (save|load) in a single process"


def _quiet():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE)
    return ctx


def _partial(path: Path) -> Path:
    return path.with_name(path.name + _PARTIAL)


def _begin(path: Path, env: Any) -> Path:
    """Rank 0 makes an empty ``<path>.partial`` (a killed save's leftover removed); all ranks wait."""
    partial = _partial(path)
    if env.is_main:
        shutil.rmtree(partial, ignore_errors=True)  # a leftover of a save that was killed
        partial.mkdir(parents=True)
    env.barrier()
    return partial


def _publish(partial: Path, path: Path, step: int, env: Any) -> None:
    """Rank 0 writes the marker into ``partial`` and renames it to ``path`` (call once every rank's
    files are written); all ranks wait."""
    if env.is_main:
        with open(partial / MARKER, "w") as f:
            f.write(f"step {step}\nworld_size {env.world_size}\n")
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            shutil.rmtree(path)
        os.replace(partial, path)
    env.barrier()


def _writer(partial: Path, threads: int) -> dcp.FileSystemWriter:
    """DCP's file writer into ``partial`` with ``threads`` (>= 1: :meth:`~dropless.train.schema.TrainConfig.validate`)
    writing threads (each writes its own file;
    one thread wrote about 0.8 GB/s, see docs/performance.md#checkpoints)."""
    return dcp.FileSystemWriter(str(partial), thread_count=int(threads))


def save(path: Path, app_state: dict[str, Stateful], env: Any, step: int, threads: int = 1) -> Path:
    """Save ``app_state`` as the checkpoint of optimizer step ``step`` at ``path`` atomically (collective:
    every rank calls it). Returns ``path``.

    Written into ``<path>.partial`` and renamed to ``path`` by rank 0 after the completion
    marker, once every rank's files are on disk; a rank killed before that leaves only the
    ``.partial`` directory, which is never loaded. An existing ``path`` (the same step saved
    again) is replaced. ``threads``: writing threads per rank (``train.ckpt_threads``).
    """
    path = Path(path)
    partial = _begin(path, env)
    ctx = _quiet()
    try:
        dcp.save(app_state, storage_writer=_writer(partial, threads))
    finally:
        ctx.__exit__(None, None, None)
    env.barrier()  # every rank's shards are written
    _publish(partial, path, int(step), env)
    return path


@dataclass
class PendingSave:
    """An asynchronous save in flight (:func:`start_save`); complete it with :func:`finish_save`.

    Attributes:
        path: the checkpoint it becomes; partial: the directory being written.
        step: the optimizer step of the state it holds; future: DCP's write (this rank's).
        group: the gloo group its ranks agree over (None in one process).
        staged_s: seconds :func:`start_save` took (the state's copy to host memory).
    """

    path: Path
    partial: Path
    step: int
    future: Future
    env: Any
    group: Any = None
    staged_s: float = 0.0


class _RefillStager(BlockingAsyncStager):
    """``BlockingAsyncStager(cache_staged_state_dict=True)``: a pinned host copy of the state made at the
    first save and refilled by each later one. Its cache must have the state's structure: where that
    changed (an optimizer state that appeared after the first save), the copy is made anew. Where the
    pinned copy cannot be made (page-locked host memory refused), it says so once and stages as DCP
    does by default from then on: a new pageable copy at every save."""

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=True)

    def stage(self, state_dict):
        if not self.cache_staged_state_dict:
            return super().stage(state_dict)
        try:
            return super().stage(state_dict)
        except Exception as e:  # noqa: BLE001 - torch's CompanionMismatch is private; pinning raises RuntimeError
            if self.state_dict_cache is not None:  # the kept copy no longer has the state's structure
                _log.info("checkpoint staging: the saved state's structure changed; making a new pinned host copy")
                self.state_dict_cache = None
                return super().stage(state_dict)
            _log.warning("checkpoint staging: could not make a pinned host copy of the saved state (%s: %s); "
                         "copying it into pageable host memory at every save instead (slower)", type(e).__name__, e)
            self.cache_staged_state_dict = False
            return super().stage(state_dict)


def host_stager(device: torch.device) -> AsyncStager | None:
    """The stager of :func:`start_save` on ``device``: on CUDA a pinned host copy kept between saves
    (the first save allocates and pins it: a few seconds for tens of GB, each tensor rounded up to a
    power of two bytes by torch's pinned allocator; each later one only copies into it, so a save must
    not start before the previous one's write is done, which :class:`Checkpointer` ensures);
    elsewhere None: DCP stages through the file writer (a new pageable copy per save).
    """
    return _RefillStager() if device.type == "cuda" else None


def start_save(path: Path, app_state: dict[str, Stateful], env: Any, step: int, group: Any = None,
               stager: AsyncStager | None = None, threads: int = 1) -> PendingSave:
    """Start an asynchronous save of ``app_state`` as step ``step``'s checkpoint at ``path`` (collective) with
    ``torch.distributed.checkpoint.async_save``.

    Returns once this rank's state is copied to host memory: the parameters and optimizer may
    change from then on, the checkpoint holds their values at this call. The files are written
    into ``<path>.partial`` by a background thread; nothing is complete until
    :func:`finish_save` (call it before the next save, and before the process ends).

    Args:
        group: with several ranks, a process group with a CPU backend (gloo) used only by the
            background writes; None in one process.
        stager: DCP's ``async_stager`` (:func:`host_stager`); None: the file writer stages (a new
            pageable copy). A stager that
            keeps its copy between saves (the pinned one) must not start a save before the
            previous save's write is finished (:func:`finish_save`).
        threads: writing threads of this rank (``train.ckpt_threads``).
    Raises:
        ValueError: several ranks and no ``group``.
    """
    if env.distributed and group is None:
        raise ValueError("start_save: with several ranks the background write needs a gloo process group of its "
                         "own (Checkpointer makes it); got group=None")
    t0 = time.perf_counter()
    path = Path(path)
    partial = _begin(path, env)
    if not env.distributed:  # DCP's note, from the writer thread (catch_warnings cannot reach it there)
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE)
    _writing.add(partial.resolve())
    try:
        # with no stager of ours DCP stages through the writer (a BlockingAsyncStager: a new host copy)
        res = dcp.async_save(app_state, storage_writer=_writer(partial, threads), process_group=group,
                             async_stager=stager)
    except BaseException:
        _writing.discard(partial.resolve())
        raise
    future = getattr(res, "upload_completion", res)  # an AsyncSaveResponse with an asynchronous stager
    return PendingSave(path, partial, int(step), future, env, group, time.perf_counter() - t0)


def finish_save(pending: PendingSave) -> Path:
    """Complete an asynchronous save (collective): wait for this rank's write, agree with every
    rank that all writes succeeded, then the marker and rename as in :func:`save`. Returns its path.

    Raises:
        SaveError: the write failed on this rank or another one (every rank raises it; this
            rank's own error is its ``__cause__``); the ``.partial`` directory stays, never loaded.
    """
    env = pending.env
    err = pending.future.exception()  # waits; DCP's CheckpointException is a BaseException
    failed = [env.rank] if err is not None else []
    if env.distributed:  # the writer thread is done with the group: the main thread may use it
        flags = torch.zeros(env.world_size, dtype=torch.int32)
        flags[env.rank] = int(err is not None)
        dist.all_reduce(flags, group=pending.group)
        failed = [r for r, f in enumerate(flags.tolist()) if f]
    _writing.discard(pending.partial.resolve())
    if failed:
        detail = _describe(err) if err is not None else f"on rank(s) {', '.join(map(str, failed))}"
        raise SaveError(f"{pending.path}: the asynchronous save of step {pending.step} failed ({detail}). It is "
                        f"not complete: {pending.partial.name} is never loaded (the next save deletes it); "
                        "resume=true continues from the newest complete checkpoint") from err
    _publish(pending.partial, pending.path, pending.step, env)
    return pending.path


def _describe(err: BaseException) -> str:
    """One line for a failed write: DCP's CheckpointException as each failing rank's error."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(failures.items()))
    return f"{type(err).__name__}: {err}"


@dataclass
class SaveNote:
    """What one :meth:`Checkpointer.save` did, for the run's console line.

    Attributes:
        path: the checkpoint. paused_s: seconds the save kept its caller (completing the save before it
            included). waited: (the save that was in flight, seconds spent completing it), or None.
        in_background: its write goes on in the background (complete at the next save).
        periodic: saved with ``wait=False`` (:meth:`Checkpointer.step_end`'s periodic saves).
    """

    path: Path
    paused_s: float
    waited: tuple[Path, float] | None
    in_background: bool
    periodic: bool


class Checkpointer:
    """A run's checkpoints: when to save, the saves (synchronous or asynchronous), the pruning after
    each, and the load.

    At most one save is in flight: :meth:`save` first completes the one before
    (:meth:`finish`). Old checkpoints are pruned (rank 0) only after a save is complete, never
    while one is being written. Collective: every rank makes it (with ``asynchronous`` and
    several ranks it creates a gloo group) and calls its methods in the same order.

    Args:
        run_dir: the run directory (checkpoints under ``<run_dir>/checkpoints``).
        env: the :class:`~dropless.train.dist.DistEnv`.
        app_state: the parts saved and restored, by their name in the checkpoint (see the module
            docstring); a plain dict entry is saved as it is and replaced by the loaded one.
        keep: newest complete checkpoints kept (``train.ckpt_keep``); 0: all.
        asynchronous: ``train.ckpt_async``: :meth:`save` with ``wait=False`` writes in the background.
        timeout_s: the gloo group's collective timeout (``train.dist_timeout_s``).
        stager: the asynchronous saves' stager; default :func:`host_stager` of the run's device
            (pinned and kept on CUDA).
        threads: writing threads per rank and save (``train.ckpt_threads``).
        every: steps between periodic saves (``train.ckpt_every``); 0: none (:meth:`due`).
    Attributes:
        pending: the :class:`PendingSave` in flight, or None.
        waited: after :meth:`save`: (the save that was in flight, seconds :meth:`save` spent
            completing it), or None if none was in flight.
        last: the :class:`SaveNote` of the latest :meth:`save`, or None.
    """

    def __init__(self, run_dir: Path, env: Any, app_state: dict[str, Stateful], *, keep: int = 0,
                 asynchronous: bool = False, timeout_s: float = 600.0, stager: AsyncStager | None | str = "auto",
                 threads: int = 1, every: int = 0):
        self.run_dir, self.env, self.app_state = Path(run_dir), env, app_state
        self.keep, self.asynchronous = int(keep), bool(asynchronous)
        self.threads, self.every = int(threads), int(every)
        self.stager = (host_stager(env.device) if stager == "auto" else stager) if self.asynchronous else None
        self.group = (dist.new_group(list(range(env.world_size)), backend="gloo",
                                     timeout=datetime.timedelta(seconds=float(timeout_s)))
                      if self.asynchronous and env.distributed else None)
        self.pending: PendingSave | None = None
        self.waited: tuple[Path, float] | None = None
        self.last: SaveNote | None = None

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` is a periodic save's (a multiple of ``every``)."""
        return bool(self.every) and step % self.every == 0

    def step_end(self, step: int, *, last: bool, stop: bool = False) -> SaveNote | None:
        """After optimizer step ``step`` (every rank, every step): save where a save is due and return
        what it did, else None. ``stop`` (a stop request every rank agreed on) and ``last`` (the run's
        last step) save with ``wait=True``: complete on return; a periodic step (:meth:`due`) saves with
        ``wait=False``: in the background with ``asynchronous``."""
        if stop or last:
            self.save(step)
        elif self.due(step):
            self.save(step, wait=False)
        else:
            return None
        return self.last

    def save(self, step: int, *, wait: bool = True) -> Path:
        """Save :attr:`app_state` as optimizer step ``step``'s ``checkpoint_dir(run_dir, step)``; returns
        that path (and sets :attr:`last`).

        First completes the save in flight, if any (:meth:`finish`; its :class:`SaveError`
        is raised here). ``wait=False`` with ``asynchronous``: returns once the state is staged,
        the write continues in the background; otherwise the checkpoint is complete (and
        pruned after) on return.
        """
        before, t0 = self.pending, time.perf_counter()
        self.finish()
        self.waited = (before.path, time.perf_counter() - t0) if before is not None else None
        path = checkpoint_dir(self.run_dir, step)
        if wait or not self.asynchronous:
            save(path, self.app_state, self.env, step, self.threads)
            self._prune()
        else:
            self.pending = start_save(path, self.app_state, self.env, step, self.group, self.stager, self.threads)
        self.last = SaveNote(path, time.perf_counter() - t0, self.waited, self.pending is not None, not wait)
        return path

    def load(self, path: Path) -> None:
        """Restore :attr:`app_state` from the checkpoint at ``path`` (:func:`load`)."""
        load(path, self.app_state)

    def finish(self) -> Path | None:
        """Complete the save in flight (waits for its write; :func:`finish_save`), then prune.
        Returns its path, or None if none was in flight. Raises :class:`SaveError`."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        path = finish_save(pending)
        self._prune()
        return path

    def after_error(self, every_rank: bool) -> str | None:
        """After an error left the training loop: complete the save in flight if ``every_rank`` takes part
        (one process, or an error every rank raises at the same step), else leave it incomplete (never
        loaded): another error may have left a rank behind, and an abort does not wait. Returns the
        note to print, or None where no save was in flight."""
        if self.pending is None:
            return None
        if not every_rank:
            name, self.pending = self.pending.path.name, None
            return (f"[dropless] the checkpoint being written ({name}) is left incomplete (never loaded); "
                    "resume=true uses the newest complete one")
        try:
            return f"[dropless] checkpoint {self.finish().name} complete"
        except Exception as e:  # noqa: BLE001 - the error that left the loop is the one to report
            return f"[dropless] {e}"

    def _prune(self) -> None:
        if self.env.is_main:
            prune(self.run_dir, self.keep)


def load(path: Path, app_state: dict[str, Stateful]) -> None:
    """Restore ``app_state``'s parts from the checkpoint at ``path`` (collective).

    Each part's ``state_dict()`` is checked against the checkpoint, filled by DCP's load in place and
    handed to the part's ``load_state_dict``, in the order of the names (as ``dcp.load`` does with
    Stateful parts; called here so that the check sees the same dicts and an error of a part's own
    restore is not taken for a damaged file); a plain dict entry is replaced by the loaded one.
    Every value of the parts must be in the checkpoint except other ranks' ``rng`` entries (a
    checkpoint saved by fewer ranks lacks them).

    Raises:
        FileNotFoundError: ``path`` holds no complete checkpoint.
        ConfigError: the checkpoint lacks a weight, moment or trainer field of this model and
            optimizer, or has other weight shapes (saved by another config), or one of its files is
            missing or damaged (the message names the older complete checkpoints).
    """
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MARKER} marker: missing, or its save was "
                                "interrupted); pick one from list_checkpoints(run_dir) / latest_checkpoint(run_dir)")
    names = sorted(app_state)
    state = {k: app_state[k].state_dict() if isinstance(app_state[k], Stateful) else app_state[k] for k in names}
    _check_complete(path, state)
    ctx = _quiet()
    try:
        dcp.load(state, checkpoint_id=str(path),
                 planner=dcp.DefaultLoadPlanner(allow_partial_load=True))  # rng of ranks not saved
    except (Exception, CheckpointException) as e:  # a file missing or cut short after COMPLETE was written
        older = [p.name for _, p in list_checkpoints(path.parent.parent) if p != path]
        where = (f"the older complete checkpoint(s) {', '.join(older[-3:])} remain: move {path.name} out of "
                 f"{path.parent} and resume=true continues from the newest of them" if older else
                 "there is no older complete checkpoint in this run directory")
        raise ConfigError(f"{path}: the checkpoint cannot be read ({_describe(e).splitlines()[0]}): one of its "
                          f"files is missing or damaged; {where}") from e
    finally:
        ctx.__exit__(None, None, None)
    for k in names:
        if isinstance(app_state[k], Stateful):
            app_state[k].load_state_dict(state[k])
        else:
            app_state[k] = state[k]


def _check_complete(path: Path, state: dict) -> None:
    """Raise ConfigError if the checkpoint lacks a weight, optimizer moment or trainer field that
    ``state`` (the parts' state dicts by name) expects: the partial load (needed for other ranks' RNG
    states) would skip it silently."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = set(meta)
    model, optim, trainer = state.get("model", {}), state.get("optim", {}), state.get("trainer", {})
    # a changed model shape (model.hidden_size=..., n_routed_experts=...): say which, before DCP's size error
    differ = [(k, tuple(meta[f"model.{k}"].size), tuple(t.shape)) for k, t in model.items()
              if isinstance(t, torch.Tensor) and hasattr(meta.get(f"model.{k}"), "size")
              and tuple(meta[f"model.{k}"].size) != tuple(t.shape)]
    if differ:
        rows = "; ".join(f"{k}: checkpoint {list(a)}, model {list(b)}" for k, a, b in differ[:4])
        more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
        raise ConfigError(f"{path}: the checkpoint's weights have other shapes than this model's: {rows}{more}. "
                          "Resume with the model.* settings the run was saved with (its config.yaml in the run "
                          "directory), or start a new run_dir")
    want = [f"model.{k}" for k in model] + [f"trainer.{k}" for k in trainer]
    for fqn, moments in optim.get("state", {}).items():
        want += [f"optim.state.{fqn}.{name}" for name in moments]
    missing = [k for k in want if k not in saved]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ConfigError(f"{path}: the checkpoint has no {', '.join(missing[:5])}{more}: it was saved by a "
                          "different model or optimizer; resume with the model.* and optim.* settings it was saved "
                          "with, or start a new run_dir")


def prune(run_dir: Path, keep: int) -> None:
    """Delete what interrupted saves left, and all but the newest ``keep`` complete checkpoints
    (call on one rank, after a save); keep <= 0: keep every complete one. An asynchronous save
    of this process still in flight is left alone (it is neither complete nor a leftover)."""
    for p in incomplete_checkpoints(run_dir):
        _log.warning("deleting %s: its save did not finish", p)
        shutil.rmtree(p, ignore_errors=True)
    if keep <= 0:
        return
    for _, p in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
