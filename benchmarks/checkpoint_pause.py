"""Checkpoint pause benchmark: how long saves stop training, one JSON line per mode.

For a recipe (default ``h200_single``) and each mode it builds a
:class:`~dropless.train.trainer.Trainer` (``logging.mode=disabled``, no validation, no periodic
saves of its own, ``train.ckpt_keep=1``) in a fresh run directory under ``--run-dir``, runs
``--warmup`` steps, then ``--saves`` times: ``--gap`` training steps and one save, as
``Trainer.train`` makes its periodic saves; then completes the save in flight and deletes the run
directory.

Modes:

``sync``            ``train.ckpt_async=false``: every save writes before training goes on.
``async``           ``train.ckpt_async=true`` with the run's own stager
                    (:func:`dropless.train.checkpoint.host_stager`: on CUDA a pinned host copy
                    kept between saves).
``async_pageable``  ``train.ckpt_async=true`` staged as on a CPU (no stager of ours: DCP stages
                    through the file writer, a new pageable host copy per save), so the two are compared in one process.

Fields: ``mode``, ``recipe``, ``device``, ``stager`` (its class name, or null: the
writer stages), ``saved_gib`` (this rank's checkpointed state: the fp32 masters and AdamW moments),
``saves`` (one entry per save: ``step``, ``paused_s`` (what the save cost training:
:meth:`~dropless.train.trainer.Trainer.save_checkpoint`'s wall time), ``waited_s`` (the part spent
completing the save before it), ``staged_s`` (async: the copy into host memory)),
``final_wait_s`` (completing the last save in flight after the loop), ``step_ms`` (median over the
gaps' steps: training beside a background write) and ``overrides``.

Usage::

    python -m benchmarks.checkpoint_pause                              # h200_single, 3 modes
    python -m benchmarks.checkpoint_pause --gap 200 --saves 2 --modes async async_pageable
    python -m benchmarks.checkpoint_pause --recipe cpu_default --warmup 1 --gap 1 --saves 2
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.train_step import emit

MODES = ("sync", "async", "async_pageable")


def run_mode(recipe: str, mode: str, overrides: list[str], warmup: int, gap: int, saves: int,
             run_root: str | None = None) -> dict[str, Any]:
    """One mode's record (see the module docstring). Raises ValueError for an unknown mode."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    from dropless.train.config import compose
    from dropless.train.startup import SAVED_BYTES_PER_PARAM
    from dropless.train.trainer import Trainer

    run_dir = Path(tempfile.mkdtemp(prefix=f"ckpt_{mode}_", dir=run_root))
    cfg = compose([f"recipe={recipe}", *overrides, f"run_dir={run_dir}", "logging.mode=disabled",
                   "logging.progress=false", "train.val_every=0", "train.ckpt_every=0", "train.ckpt_keep=1",
                   f"train.ckpt_async={str(mode != 'sync').lower()}", f"train.steps={warmup + gap * saves + 1}"])
    tr = Trainer(cfg)
    try:
        if mode == "async_pageable":
            tr.checkpoints.stager = None
        step_ms: list[float] = []
        records = []
        for _ in range(warmup):
            tr.train_step()
        for _ in range(saves):
            for _ in range(gap):
                t0 = time.perf_counter()
                tr.train_step()  # reads its metrics: the step is done on the device when it returns
                step_ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            tr.save_checkpoint(wait=mode == "sync")
            paused = time.perf_counter() - t0
            waited = tr.checkpoints.waited
            pending = tr.checkpoints.pending
            records.append({"step": tr.step, "paused_s": round(paused, 3),
                            "waited_s": round(waited[1], 3) if waited is not None else 0.0,
                            "staged_s": round(pending.staged_s, 3) if pending is not None else None})
        t0 = time.perf_counter()
        tr.checkpoints.finish()
        final_wait = time.perf_counter() - t0
        stager = tr.checkpoints.stager
        return {"mode": mode, "recipe": recipe, "device": tr.env.device.type if tr.env.device.type == "cpu"
                else torch.cuda.get_device_name(tr.env.device),
                "stager": type(stager).__name__ if stager is not None else None,
                "saved_gib": round(tr.param_counts.total / tr.env.world_size * SAVED_BYTES_PER_PARAM / 2**30, 3),
                "saves": records, "final_wait_s": round(final_wait, 3),
                "step_ms": round(statistics.median(step_ms), 2) if step_ms else None, "overrides": overrides}
    finally:
        tr.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="h200_single")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--warmup", type=int, default=3, help="steps before the first gap (compile happens here)")
    p.add_argument("--gap", type=int, default=30, help="training steps before each save")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--run-dir", default=None, help="where the run directories go (default: the system's temp dir; "
                                                   "a checkpoint of h200_single is about 21 GiB)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override, repeatable")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    a = p.parse_args(argv)
    if a.gap < 1 or a.saves < 1 or a.warmup < 0:
        p.error("--gap and --saves must be >= 1, --warmup >= 0")
    for mode in a.modes:
        with contextlib.redirect_stdout(sys.stderr):  # the trainer's own lines: stdout carries only JSON
            rec = run_mode(a.recipe, mode, a.overrides, a.warmup, a.gap, a.saves, a.run_dir)
        emit(rec, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
