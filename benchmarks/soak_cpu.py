"""Soak test of the CPU recipe on 2 ranks: does any worker's memory grow over a long run?

Runs ``torchrun --nproc_per_node 2 -m dropless.train train.steps=N num_threads=1 [overrides]``
(at ``nice -n 19``) and, each time the run's ``metrics.jsonl`` reaches a multiple of
``--every`` steps, reads the current resident set size (``VmRSS`` of ``/proc/PID/status``)
of each worker process. Prints one JSON line per sample and a summary line; ``--out`` appends
them to a JSON-lines file (``benchmarks/results/soak_cpu.jsonl``).

Growth is measured after warm-up (``--warmup`` steps): ``(max RSS after warm-up − RSS at
warm-up) / RSS at warm-up``, per rank.

    python benchmarks/soak_cpu.py --steps 2000 --out benchmarks/results/soak_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _last_step(metrics: Path) -> tuple[int, dict] | None:
    if not metrics.exists():
        return None
    lines = metrics.read_text().splitlines()
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        return int(rec["step"]), rec
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()

    run_dir = Path(tempfile.mkdtemp(prefix="soak-")) / "run"
    cmd = ["nice", "-n", "19", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "dropless.train", f"train.steps={a.steps}", "num_threads=1", "logging.progress=false",
           f"run_dir={run_dir}", *a.overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples, next_step, workers = [], a.every, []
    while proc.poll() is None:
        time.sleep(0.5)
        if len(workers) < 2:  # torchrun's children running dropless.train
            workers = sorted(p for p in _children(proc.pid) if b"dropless.train" in _cmdline(p))
        got = _last_step(run_dir / "metrics.jsonl")
        if got is None or got[0] < next_step:
            continue
        step, rec = got
        rss = [_rss_mib(p) for p in workers]
        s = {"step": step, "wall_s": round(time.time() - t0, 1), "rss_mib": rss,
             "peak_rss_gib_rank0": rec.get("peak_mem_gib"), "loss": rec.get("loss")}
        samples.append(s)
        print(json.dumps(s), flush=True)
        next_step = (step // a.every + 1) * a.every
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        print(err[-4000:], file=sys.stderr)
        return proc.returncode

    warm = [s for s in samples if s["step"] >= a.warmup and all(r is not None for r in s["rss_mib"])]
    growth = None
    if warm:
        base = warm[0]["rss_mib"]
        growth = [max(s["rss_mib"][i] for s in warm) / base[i] - 1 for i in range(len(base))]
    summary = {"bench": "soak_cpu", "steps": a.steps, "ranks": 2, "num_threads": 1, "overrides": a.overrides,
               "wall_s": round(time.time() - t0, 1), "warmup_steps": a.warmup,
               "rss_mib_at_warmup": warm[0]["rss_mib"] if warm else None,
               "rss_mib_max_after_warmup": [max(s["rss_mib"][i] for s in warm) for i in range(2)] if warm else None,
               "growth_after_warmup": growth,
               "last_over_warmup": ([warm[-1]["rss_mib"][i] / warm[0]["rss_mib"][i] - 1 for i in range(2)]
                                    if warm else None),
               "python": platform.python_version(),
               "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)"}
    print(json.dumps(summary), flush=True)
    if a.out:
        with a.out.open("a") as f:
            for s in samples:
                f.write(json.dumps({"bench": "soak_cpu_sample", **s}) + "\n")
            f.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
