"""FP8 expert GEMMs in training, on a CPU: ``gemm=fp8``'s numerics, emulated, against ``gemm=torch``.

Trains the CPU default recipe (``configs/model/tiny.yaml``, fp32, the stdlib's bytes) twice
from the same seed: with ``gemm=torch`` and with the ``fp8`` backend in its emulation mode
(:class:`~dropless.ops.fp8_backend.Fp8Backend` ``emulate=True``: the same e4m3 operands and
rowwise / per-channel scales as the CUDA kernel, multiplied in fp32 per expert), registered
here as ``gemm=fp8_emulated``. Forward FC1/FC2 and the data gradients go through FP8; the
weight gradients stay in the run's dtype (fp32 here, bf16 on a GPU), as in ``gemm=fp8``.

What it says: whether e4m3 quantisation of the expert GEMMs changes where training goes
(issue 14 asks for ≤ 1 % of bf16's loss after 200 steps of ``recipe=h200_single`` on a GPU;
this is the same quantisation at the CPU recipe's scale, against fp32, not that run).
What it does not: speed, the CUDA kernel's accumulation order, bf16 rounding elsewhere.

One JSON line per run (final validation loss, mean of the last 20 training losses, seconds)
and a comparison line (relative differences, the largest per-step training-loss gap)::

    python benchmarks/fp8_training_emulated.py --steps 300 --out benchmarks/results/cpu_fp8_emulated_training.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch


def _run(backend: str, steps: int, run_dir: Path, extra: list[str]) -> dict:
    from dropless.train.config import compose
    from dropless.train.trainer import Trainer

    cfg = compose([f"gemm.backend={backend}", f"train.steps={steps}", f"run_dir={run_dir}", "logging.mode=disabled",
                   "logging.progress=false", "train.ckpt_every=0", *extra])
    t0 = time.perf_counter()
    tr = Trainer(cfg)
    try:
        summary = tr.train()
    finally:
        tr.close()
    secs = time.perf_counter() - t0
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if "loss" in r]
    vals = [r["val_loss"] for r in recs if r.get("val_loss") is not None]
    return dict(gemm=backend, steps=steps, final_val_loss=vals[-1] if vals else None,
                first_val_loss=vals[0] if vals else None,
                last20_train_loss=sum(losses[-20:]) / len(losses[-20:]), train_losses=losses, seconds=round(secs, 1),
                interrupted=bool(summary.get("interrupted", False)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs (e.g. seed=1)")
    a = p.parse_args(argv)

    from dropless.ops.backends import register_backend
    from dropless.ops.fp8_backend import Fp8Backend

    register_backend("fp8_emulated", lambda: Fp8Backend(emulate=True))
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = {b: _run(b, a.steps, Path(tmp) / b, list(a.overrides)) for b in ("torch", "fp8_emulated")}
    ref, q = runs["torch"], runs["fp8_emulated"]
    gaps = [abs(x - y) / abs(y) for x, y in zip(q["train_losses"], ref["train_losses"])]
    for r in runs.values():
        lines.append({k: v for k, v in r.items() if k != "train_losses"})
    lines.append(dict(
        compare="fp8_emulated vs torch", steps=a.steps, overrides=list(a.overrides),
        final_val_rel_diff=(q["final_val_loss"] - ref["final_val_loss"]) / ref["final_val_loss"],
        last20_train_rel_diff=(q["last20_train_loss"] - ref["last20_train_loss"]) / ref["last20_train_loss"],
        max_step_rel_gap=max(gaps), max_step_rel_gap_at=gaps.index(max(gaps)) + 1,
        torch=torch.__version__, machine=platform.machine(), date=time.strftime("%Y-%m-%d")))
    text = "\n".join(json.dumps(x) for x in lines)
    print(text)
    if a.out is not None:
        with a.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
