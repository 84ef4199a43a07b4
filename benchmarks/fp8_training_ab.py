"""FP8 expert GEMMs in training: the same run with ``gemm=torch`` and with an FP8 backend, same seed.

Builds the :class:`~dropless.train.trainer.Trainer` of a recipe twice (``gemm=torch``, then
``gemm=<--gemm>``), runs ``--steps`` optimizer steps with :meth:`~dropless.train.trainer.Trainer.train_step`
(no checkpoint is written: at ``recipe=h200_single`` one is 30 GB) and measures the validation
loss at the end. Issue 14 asks ``recipe=h200_single gemm=fp8`` to end within 1 % of bf16's loss
after 200 steps::

    python benchmarks/fp8_training_ab.py --recipe h200_single --steps 200 \
        --out benchmarks/results/h200_fp8_training_ab.jsonl

On a CPU, ``--emulate`` runs ``gemm=fp8``'s numerics through its emulation
(:class:`~dropless.ops.fp8_backend.Fp8Backend` ``emulate=True``: the same e4m3 operands and
scales as the CUDA kernel, multiplied in fp32 per expert), registered as ``fp8_emulated``, on the
CPU default recipe (fp32)::

    python benchmarks/fp8_training_ab.py --emulate --steps 200 num_threads=1

One JSON line per run (final validation loss, mean of the last 20 training losses, seconds,
tokens/s) and a comparison line (relative differences, the largest per-step training-loss gap).
Extra Hydra overrides apply to both runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch


def _run(gemm: str, recipe: str | None, steps: int, run_dir: Path, extra: list[str]) -> dict:
    from dropless.train.config import compose
    from dropless.train.trainer import Trainer

    cfg = compose(([f"recipe={recipe}"] if recipe else []) + [
        f"gemm.backend={gemm}", f"train.steps={steps}", f"run_dir={run_dir}", "logging.mode=disabled",
        "logging.progress=false", *extra])
    tr = Trainer(cfg)
    try:
        t0 = time.perf_counter()
        recs = [tr.train_step() for _ in range(steps)]
        secs = time.perf_counter() - t0
        val = tr.validate()
    finally:
        tr.close()
    losses = [r["loss"] for r in recs]
    tail = losses[-20:]
    return dict(gemm=gemm, recipe=recipe, steps=steps, final_val_loss=val, last20_train_loss=sum(tail) / len(tail),
                train_losses=losses, seconds=round(secs, 1),
                tokens_per_s=round(sum(r["tokens_per_s"] for r in recs[-20:]) / len(recs[-20:]), 1),
                skipped_steps=int(recs[-1].get("skipped_steps", 0)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=None, help="a recipe name (default: the CPU default config)")
    p.add_argument("--gemm", default="fp8", help="the FP8 backend to compare with gemm=torch (fp8, deep_gemm)")
    p.add_argument("--emulate", action="store_true", help="CPU: gemm=fp8's emulation instead of the CUDA kernel")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs (e.g. seed=1)")
    a = p.parse_args(argv)

    gemm = a.gemm
    if a.emulate:
        from dropless.ops.backends import register_backend
        from dropless.ops.fp8_backend import Fp8Backend

        register_backend("fp8_emulated", lambda: Fp8Backend(emulate=True))
        gemm = "fp8_emulated"
    with tempfile.TemporaryDirectory() as tmp:
        runs = {g: _run(g, a.recipe, a.steps, Path(tmp) / g, list(a.overrides)) for g in ("torch", gemm)}
    ref, q = runs["torch"], runs[gemm]
    gaps = [abs(x - y) / abs(y) for x, y in zip(q["train_losses"], ref["train_losses"])]
    lines = [{k: v for k, v in r.items() if k != "train_losses"} for r in runs.values()]
    lines.append(dict(
        compare=f"{gemm} vs torch", recipe=a.recipe, steps=a.steps, overrides=list(a.overrides),
        final_val_rel_diff=(q["final_val_loss"] - ref["final_val_loss"]) / ref["final_val_loss"],
        last20_train_rel_diff=(q["last20_train_loss"] - ref["last20_train_loss"]) / ref["last20_train_loss"],
        max_step_rel_gap=max(gaps), max_step_rel_gap_at=gaps.index(max(gaps)) + 1,
        speedup=q["tokens_per_s"] / ref["tokens_per_s"],
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        torch=torch.__version__, date=time.strftime("%Y-%m-%d")))
    text = "\n".join(json.dumps(x) for x in lines)
    print(text)
    if a.out is not None:
        with a.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
