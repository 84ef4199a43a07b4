"""FP8 expert GEMMs in training: the same run with ``gemm=torch`` and with an FP8 backend, same seed.

Builds the :class:`~dropless.train.trainer.Trainer` of a recipe twice (``gemm=torch``, then
``gemm=<--gemm>``), runs ``--steps`` optimizer steps with :meth:`~dropless.train.trainer.Trainer.train_step`
(no checkpoint is written: at ``recipe=h200_single`` one is 30 GB) and measures the validation
loss at the end; the target is ``recipe=h200_single gemm=fp8`` within 1 % of bf16's loss
after 200 steps::

    python benchmarks/fp8_training_ab.py --recipe h200_single --steps 200 \
        --out benchmarks/results/fp8_training.jsonl

On a CPU, ``--emulate`` runs ``gemm=fp8``'s numerics through its emulation
(:class:`~dropless.ops.fp8_backend.Fp8Backend` ``emulate=True``: the same e4m3 operands and
scales as the CUDA kernel, multiplied in fp32 per expert), registered as ``fp8_emulated``, on the
CPU default recipe (fp32)::

    python benchmarks/fp8_training_ab.py --emulate --steps 200 num_threads=1

The reference runs ``--reference-runs`` times (default 2, same seed): on CUDA the bf16 step is
not bitwise repeatable (atomic adds in the scatter / index backward, cuDNN attention's backward),
and at ``h200_single``'s learning rate two same-seed bf16 runs drift apart as any perturbation
does (docs/performance.md#fp8-experts gives the spread measured). A gap between FP8 and bf16 means something
only next to that spread, so the comparison line reports both.

One JSON line per run (final validation loss, mean of the last 20 and last 50 training losses
(of all of them when there are fewer), every step's training loss, seconds, tokens/s over the
last 20 steps: the first steps of the first run include warm-up) and a comparison line: the FP8 run against the
mean of the reference runs (``*_rel_diff``), the reference runs' own spread
(``reference_spread_*``: (max - min) / mean), the largest per-step gap to the first reference
run and the speed-up (null under ``--emulate``). Extra Hydra overrides apply to every run.
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
    tail50 = losses[-50:]
    return dict(gemm=gemm, recipe=recipe, steps=steps, final_val_loss=val, last20_train_loss=sum(tail) / len(tail),
                last50_train_loss=sum(tail50) / len(tail50), train_losses=losses, seconds=round(secs, 1),
                tokens_per_s=round(sum(r["tokens_per_s"] for r in recs[-20:]) / len(recs[-20:]), 1),
                skipped_steps=int(recs[-1].get("skipped_steps", 0)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=None, help="a recipe name (default: the CPU default config)")
    p.add_argument("--gemm", default="fp8", help="the FP8 backend to compare with gemm=torch (fp8, deep_gemm)")
    p.add_argument("--emulate", action="store_true", help="CPU: gemm=fp8's emulation instead of the CUDA kernel")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reference-runs", type=int, default=2,
                   help="gemm=torch runs (same seed) whose spread is the noise floor (>= 1)")
    p.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs (e.g. seed=1)")
    a = p.parse_args(argv)

    gemm = a.gemm
    if a.emulate:
        from dropless.ops.backends import register_backend
        from dropless.ops.fp8_backend import Fp8Backend

        register_backend("fp8_emulated", lambda: Fp8Backend(emulate=True))
        gemm = "fp8_emulated"
    if a.reference_runs < 1:
        p.error("--reference-runs must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        refs = [_run("torch", a.recipe, a.steps, Path(tmp) / f"torch{i}", list(a.overrides))
                for i in range(a.reference_runs)]
        q = _run(gemm, a.recipe, a.steps, Path(tmp) / gemm, list(a.overrides))
    lines = [r for r in refs] + [q]
    cmp = dict(compare=f"{gemm} vs torch", recipe=a.recipe, steps=a.steps, overrides=list(a.overrides),
               reference_runs=len(refs))
    for key in ("final_val_loss", "last20_train_loss", "last50_train_loss"):
        vals = [r[key] for r in refs]
        mean = sum(vals) / len(vals)
        name = key.removesuffix("_loss")
        cmp[f"{name}_rel_diff"] = (q[key] - mean) / mean
        cmp[f"reference_spread_{name}"] = (max(vals) - min(vals)) / mean
    gaps = [abs(x - y) / abs(y) for x, y in zip(q["train_losses"], refs[0]["train_losses"])]
    # under --emulate the FP8 run multiplies per expert in fp32 on the host: its speed means nothing
    speedup = None if a.emulate else q["tokens_per_s"] / (sum(r["tokens_per_s"] for r in refs) / len(refs))
    cmp.update(max_step_rel_gap=max(gaps), max_step_rel_gap_at=gaps.index(max(gaps)) + 1, speedup=speedup,
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
               torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    lines.append(cmp)
    text = "\n".join(json.dumps(x) for x in lines)
    print(text)
    if a.out is not None:
        with a.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
