"""What a run says on the terminal, and the signals that stop it.

:class:`Console` prints on rank 0 only (through ``tqdm.write``, so the progress bar stays at the
bottom): the start-up warnings (kept in :attr:`Console.warnings`, which ``dropless-train``
repeats below the resolved config), the run's opening lines (:meth:`Console.opening`), the
checkpoint notes, the progress bar (:meth:`Console.progress`) and the closing ``done:`` line
(:meth:`Console.done`). :class:`StopSignals` turns SIGINT/SIGTERM into a stop request.
"""

from __future__ import annotations

import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

__all__ = ["ABORT_AFTER_S", "Console", "StopSignals", "divergence", "speed_note"]

ABORT_AFTER_S = 3.0  # a second SIGINT/SIGTERM later than this after the first aborts at once


class StopSignals:
    """SIGINT/SIGTERM as a stop request: the first sets :attr:`signum` (the current step finishes, a
    checkpoint is written, the run stops); a second one more than :data:`ABORT_AFTER_S` seconds later
    raises KeyboardInterrupt (a repeat within that time is torchrun forwarding the same Ctrl-C to its
    workers). Installed by ``with`` (main thread only; elsewhere nothing is installed)."""

    def __init__(self, console: Console):
        self.console = console
        self.signum: int | None = None
        self._time = 0.0
        self._old: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __call__(self, signum, frame) -> None:  # noqa: ARG002
        if self.signum is not None:
            if time.monotonic() - self._time > ABORT_AFTER_S:
                raise KeyboardInterrupt
            return
        self.signum, self._time = signum, time.monotonic()
        if self.console.main:
            print(f"\n[dropless] {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                  "(again to abort)", file=sys.stderr, flush=True)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


class Console:
    """Rank 0's messages. ``main``: whether this process prints; ``progress``: ``logging.progress``."""

    def __init__(self, main: bool, progress: bool = True):
        self.main = main
        self.show_progress = progress
        #: the start-up warnings, as printed
        self.warnings: list[str] = []

    def print(self, *a: Any) -> None:
        if self.main:
            tqdm.write(" ".join(str(x) for x in a), file=sys.stdout)

    def warn(self, note: str | None) -> None:
        """Print a start-up warning (rank 0) and keep it in :attr:`warnings`; None (the start-up notes'
        "nothing to say") does neither."""
        if note is None:
            return
        self.warnings.append(note)
        self.print(f"[dropless] warning: {note}")

    def progress(self, total: int, initial: int) -> tqdm:
        """The progress bar over the optimizer steps (rank 0, ``logging.progress``), on stderr."""
        return tqdm(total=total, initial=initial, disable=not (self.main and self.show_progress), desc="train",
                    unit="step", dynamic_ncols=True, mininterval=1.0, file=sys.stderr)

    def opening(self, tr: Any) -> None:
        """The run's opening lines: run directory, model, world, data, and where it starts."""
        if not self.main:
            return
        pc, args, env = tr.param_counts, tr.args, tr.env
        self.print(f"[dropless] run dir {tr.run_dir}")
        self.print(f"[dropless] model: {pc.total / 1e6:.2f}M parameters, {pc.activated / 1e6:.2f}M activated "
                   f"per token; {args.num_moe_layers} MoE layers of E={args.n_routed_experts} "
                   f"k={args.num_experts_per_tok}; dispatcher={tr.cfg.dispatcher.name}")
        self.print(f"[dropless] world {env.world_size} = dp {env.dp_size} x ep {env.ep_size} on "
                   f"{env.device.type}, {torch.get_num_threads()} thread(s)/process; "
                   f"{tr.tokens_per_step:,} tokens per step")
        self.print(f"[dropless] data: {tr.tokens.source}")
        if tr.resumed_from is not None and tr.step >= tr.steps:
            self.print(f"[dropless] the run in {tr.run_dir} already finished: its newest checkpoint is at step "
                       f"{tr.step} and train.steps={tr.steps}; nothing to train (raise train.steps to continue it)")
        elif tr.resumed_from is not None:
            self.print(f"[dropless] resumed from step {tr.resumed_from}")
        elif tr.cfg.resume:
            self.print("[dropless] resume=true but no checkpoint in run_dir: starting at step 0")

    def done(self, tr: Any, wall: float, step0: int, first_val: float | None, last_val: float | None) -> None:
        """The closing ``done:`` line (a run that was not interrupted)."""
        if not self.main or tr.interrupted:
            return
        metrics = tr.run_dir / "metrics.jsonl"
        if tr.step == tr.resumed_from:  # (opening said why)
            self.print(f"[dropless] done: nothing to train; metrics {metrics}")
            return
        if last_val is None:
            v = "not measured (train.val_every=0)"
        else:
            v = f"{last_val:.4f}" if first_val is None else f"{first_val:.4f} -> {last_val:.4f}"
        skipped = f" ({tr.skipped_steps} optimizer steps skipped: non-finite)" if tr.skipped_steps else ""
        done = (f"steps {tr.resumed_from} -> {tr.step} ({tr.step - tr.resumed_from} trained)"
                if tr.resumed_from else f"{tr.step} steps")
        self.print(f"[dropless] done: {done} in {wall:.1f}s{skipped}{speed_note(tr.history, step0)}; val_loss {v}; "
                   f"metrics {metrics}")

    def saved(self, path: Path, paused: float, waited: tuple[Path, float] | None, in_background: bool,
              periodic: bool, ckpt_every: int) -> None:
        """A checkpoint's note: how long training paused, and a wait for the write before it."""
        if waited is not None and waited[1] >= 1.0:  # the last save (or a signal's): part of its pause
            why = (f" (saves {ckpt_every} steps apart come faster than one is written): raise train.ckpt_every, "
                   "or set train.ckpt_async=false" if periodic else " first")  # a periodic save caught up with it
            self.print(f"[dropless] checkpoint {path.name}: waited {waited[1]:.1f} s for {waited[0].name}'s "
                       f"background write to finish{why}")
        if in_background:
            self.print(f"[dropless] checkpoint {path.name}: training paused {paused:.1f} s (staged in host memory "
                       "and written in the background; complete at the next save)")
        else:
            self.print(f"[dropless] checkpoint {path.name} saved: training paused {paused:.1f} s")


def speed_note(history: list[dict], step0: int) -> str:
    """``"; median N tokens/s (MFU m %), peak memory p GiB"`` over the records after ``step0`` (the
    median, so the first steps' compiling and CUDA-graph capture do not count; the memory is
    :func:`~dropless.train.metrics.peak_memory_gib`'s: CUDA allocated, else the RSS)."""
    recs = [r for r in history if r["step"] > step0]
    if not recs:
        return ""
    note = f"; median {statistics.median(r['tokens_per_s'] for r in recs):,.0f} tokens/s"
    if recs[-1]["mfu"] is not None:
        note += f" (MFU {100 * statistics.median(r['mfu'] for r in recs):.1f} %)"
    return note + f", peak memory {max(r['peak_mem_gib'] for r in recs):.1f} GiB"


def divergence(step: int, trained: int, skipped: int, last_skipped: bool, validates: bool,
               nonfinite_val_steps: list[int]) -> str | None:
    """``train.nonfinite=skip``: why a run of ``trained`` steps (``skipped`` of them skipped; ending at
    ``step``) did not end sound, or None. Unsound: a validation loss was non-finite (at
    ``nonfinite_val_steps``); every step was skipped; or the last step was skipped with no validation
    (``validates`` false: ``train.val_every=0``), so nothing shows the final weights give a finite loss."""
    if trained == 0:
        return None
    why, cause = [], "skipped for a non-finite loss or gradient norm"
    if skipped == trained:
        why.append(f"every optimizer step of the run ({trained}) was {cause}: nothing was trained")
    elif nonfinite_val_steps or (last_skipped and not validates):
        why.append(f"{skipped} of {trained} optimizer steps were {cause}")
        if last_skipped and not validates:
            why.append(f"the last step ({step}) among them, with no validation (train.val_every=0) to show "
                       "that the final weights give a finite loss")
    if nonfinite_val_steps:
        at = ", ".join(map(str, nonfinite_val_steps))
        why.append(f"the validation loss was non-finite at step{'s' if ',' in at else ''} {at}")
    if not why:
        return None
    return (f"training diverged (train.nonfinite=skip): {'; '.join(why)}. The checkpoint of step {step} "
            "holds the weights of the last step applied; lower optim.lr or check the data")
