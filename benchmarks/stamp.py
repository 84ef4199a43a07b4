"""Stamp benchmark output for ``benchmarks/results/``: add ``date``, ``commit``, ``gpu`` and ``torch``.

Reads JSON lines on stdin (what every benchmark prints), writes them to stdout with the four
fields first; other lines pass through unchanged::

    python -m benchmarks.train_step | python benchmarks/stamp.py >> benchmarks/results/train_step.jsonl

``date``: today (UTC, ``YYYY-MM-DD``); ``commit``: ``git rev-parse --short HEAD`` of the checkout
(``+dirty`` with uncommitted changes; null outside a git checkout); ``gpu``: ``H200``/``H100`` when
the CUDA device's name says so, else that name, ``CPU`` without CUDA; ``torch``:
``torch.__version__``. ``--gpu`` and ``--commit`` override the detected values. A field the line
already has is kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import IO

import torch

ROOT = Path(__file__).resolve().parent.parent


def detect_commit() -> str | None:
    """The checkout's short commit, ``+dirty`` if tracked files changed; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def detect_gpu() -> str:
    """``H200`` / ``H100`` / the CUDA device's name, or ``CPU``."""
    if not torch.cuda.is_available():
        return "CPU"
    name = torch.cuda.get_device_name()
    return next((k for k in ("H200", "H100") if k in name), name)


def stamp(lines: IO[str], out: IO[str], fields: dict) -> int:
    """Write each JSON-object line of ``lines`` with ``fields`` first; returns how many were stamped."""
    n = 0
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            d = None
        if not isinstance(d, dict):
            out.write(line)
            continue
        out.write(json.dumps({**fields, **d}) + "\n")
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    """Stamp stdin to stdout; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", help="the GPU field (default: detected)")
    p.add_argument("--commit", help="the commit field (default: the checkout's HEAD)")
    args = p.parse_args(argv)
    fields = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "commit": args.commit or detect_commit(), "gpu": args.gpu or detect_gpu(),
              "torch": torch.__version__}
    stamp(sys.stdin, sys.stdout, fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
