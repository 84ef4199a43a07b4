"""Draw the pictures of docs/ from the JSON-lines files in benchmarks/results/.

    pip install -e ".[plot]"          # matplotlib
    python benchmarks/plot.py         # writes docs/img/*.png

Each picture takes the newest lines of its measurement (the figures of the README's table) and
names the date, commit and GPU they come from in its title:

* ``train_step.png``: training tokens/s and peak memory at ``recipe=h200_single``, dropless
  (``train_step.jsonl``, the recipe's eager + CUDA-graph step) against torchtitan 0.3.0's
  DeepSeek-V3 at the same shape (``peers.jsonl``).
* ``moe_layer.png``: forward + backward TFLOP/s of the experts alone and of the whole MoE layer,
  and the whole layer's peak memory, dropless (``moe_layer.jsonl``, bf16) against torchtitan
  0.3.0's MoE (``peers.jsonl``), with the dense bf16 GEMM ceiling.
* ``live_rows.png``: the SwiGLU kernels' time against the number of live rows in one 28,672-row
  buffer (``live_rows.jsonl``), beside torch.compile's dense kernel over the whole buffer: the
  live-row kernels' time follows the live rows, not the buffer.

Raises:
    SystemExit: matplotlib is not installed (the message says how to install it), or a results
        file lacks the lines a picture needs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "img"

DROPLESS, PEER, CEILING = "#1f77b4", "#9a9a9a", "#d62728"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("benchmarks/plot.py needs matplotlib: pip install -e \".[plot]\" "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def read(name: str) -> list[dict]:
    """The lines of ``benchmarks/results/NAME`` as dicts."""
    with open(RESULTS / name) as f:
        return [json.loads(line) for line in f if line.strip()]


def newest(lines: list[dict], what: str, **match) -> dict:
    """The last line (by date, then file order) whose fields equal ``match``."""
    hits = [d for d in lines if all(d.get(k) == v for k, v in match.items())]
    if not hits:
        raise SystemExit(f"benchmarks/results: no line of {what} with {match}")
    return max(enumerate(hits), key=lambda p: (p[1]["date"], p[0]))[1]


def _source(d: dict) -> str:
    return f"{d['date']}, {d['commit']}, {d['gpu']}"


def _bars(ax, labels, values, colors, fmt):
    bars = ax.bar(labels, values, color=colors, width=0.6)
    for b, v in zip(bars, values):
        ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                    xytext=(0, 3), textcoords="offset points")
    ax.set_ylim(0, max(values) * 1.18)
    ax.spines[["top", "right"]].set_visible(False)


def _save(plt, fig, path: Path) -> Path:
    """Lay out ``fig``, write it to ``path`` (PNG, 120 dpi) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def train_step(plt, out: Path) -> Path:
    ours = newest(read("train_step.jsonl"), "train_step", gpu="H200", variant="eager+graph")
    peer = newest(read("peers.jsonl"), "the torchtitan training step", bench="train_step")
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.6))
    names = ["dropless", "torchtitan 0.3.0"]
    _bars(a, names, [ours["tokens_per_s"] / 1e3, peer["tokens_per_s"] / 1e3], [DROPLESS, PEER], "{:.1f} k")
    a.set_ylabel("tokens/s (thousands), higher is better")
    a.set_title("training throughput")
    _bars(b, names, [ours["peak_mem_gib"], peer["peak_mem_gib"]], [DROPLESS, PEER], "{:.1f} GiB")
    b.set_ylabel("peak GPU memory (GiB), lower is better")
    b.set_title("peak memory")
    fig.suptitle(f"recipe=h200_single, one {ours['gpu']} (dropless {_source(ours)}; torchtitan {peer['date']})",
                 fontsize=9)
    return _save(plt, fig, out / "train_step.png")


def moe_layer(plt, out: Path) -> Path:
    lines = read("moe_layer.jsonl")
    experts = newest(lines, "moe_layer", bench="experts_only", gemm="torch", alignment=128)
    layer = newest(lines, "moe_layer", bench="whole_layer", label="new", alignment=128)
    peers = read("peers.jsonl")
    p_experts = newest(peers, "peers", bench="experts_only")
    p_layer = newest(peers, "peers", bench="whole_layer")
    ceiling = newest(peers, "peers", bench="dense_ceiling")
    fig, (a, b) = plt.subplots(1, 2, figsize=(8.6, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    x = [0, 1]
    w = 0.36
    ours = [experts["fwdbwd_tflops"], layer["fwdbwd_tflops"]]
    theirs = [p_experts["fwdbwd_tflops"], p_layer["fwdbwd_tflops"]]
    for dx, vals, color, name in ((-w / 2, ours, DROPLESS, "dropless"), (w / 2, theirs, PEER, "torchtitan 0.3.0")):
        bars = a.bar([i + dx for i in x], vals, w, color=color, label=name)
        for bar, v in zip(bars, vals):
            a.annotate(f"{v:.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom",
                       xytext=(0, 3), textcoords="offset points")
    a.axhline(ceiling["tflops"], color=CEILING, ls="--", lw=1)
    a.text(0.01, ceiling["tflops"], f" dense bf16 GEMM ceiling, {ceiling['tflops']:.0f}", color=CEILING,
           ha="left", va="bottom", fontsize=8, transform=a.get_yaxis_transform())
    a.set_xticks(x, ["experts alone\n(4 experts, 65,536 rows)", "whole MoE layer\n(T 8192, E 32, k 8)"])
    a.set_ylabel("forward + backward TFLOP/s")
    a.set_ylim(0, ceiling["tflops"] * 1.3)
    a.legend(loc="upper right", fontsize=8, ncol=2, frameon=False)
    a.spines[["top", "right"]].set_visible(False)
    a.set_title("speed (higher is better)")
    _bars(b, ["dropless", "torchtitan\n0.3.0"], [layer["peak_gib"], p_layer["peak_gib"]], [DROPLESS, PEER],
          "{:.1f} GiB")
    b.set_ylabel("peak memory of the layer (GiB)")
    b.set_title("memory (lower is better)")
    fig.suptitle(f"MoE layer, H 7168, I 2048, bf16, one {layer['gpu']} (dropless {_source(layer)}; "
                 f"torchtitan {p_layer['date']})", fontsize=9)
    return _save(plt, fig, out / "moe_layer.png")


def live_rows(plt, out: Path) -> Path:
    lines = [d for d in read("live_rows.jsonl") if d.get("bench") == "seed_activation"]
    date, commit = max((d["date"], d["commit"]) for d in lines if d.get("variant") == "new:live3072")
    run = [d for d in lines if (d["date"], d["commit"]) == (date, commit)]

    def us(op: str, variant: str) -> float:
        vals = [d["us"] for d in run if d.get("op") == op and d.get("variant") == variant]
        if not vals:
            raise SystemExit(f"live_rows.jsonl ({date}, {commit}): no {op} line for {variant}")
        return statistics.median(vals)

    alloc = next(d["rows_alloc"] for d in run if d.get("variant") == "new:full")
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for op, name, marker in (("swiglu_fwd", "SwiGLU forward", "o"), ("swiglu_bwd", "SwiGLU backward", "s")):
        xs = [3072, alloc]
        ys = [us(op, "new:live3072"), us(op, "new:full")]
        ax.plot(xs, ys, marker=marker, label=f"dropless {name} (live rows only)")
    dense = us("swiglu_fwd", "torch.compile:dense")
    ax.axhline(dense, color=PEER, ls="--", lw=1.2)
    ax.annotate(f"torch.compile SwiGLU forward over all {alloc:,} rows: {dense:.0f} µs", (alloc * 0.02, dense),
                ha="left", va="bottom", fontsize=8, color="#555555", xytext=(0, 3), textcoords="offset points")
    ax.set_xlim(0, alloc * 1.05)
    ax.set_ylim(0, None)
    ax.set_xlabel(f"live rows in a buffer of {alloc:,} rows (32 experts, I 2048, bf16)")
    ax.set_ylabel("kernel time (µs)")
    ax.legend(loc="upper left", fontsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    timer = run[0].get("timing", "flush")
    ax.set_title(f"time follows the live rows, not the buffer ({date}, {commit}, {run[0]['gpu']}, {timer} timer)",
                 fontsize=9)
    return _save(plt, fig, out / "live_rows.png")


def main(argv: list[str] | None = None) -> int:
    """Write every picture into ``--out`` (default ``docs/img``); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT, help="directory of the PNGs (default docs/img)")
    args = p.parse_args(argv)
    plt = _pyplot()
    args.out.mkdir(parents=True, exist_ok=True)
    for draw in (train_step, moe_layer, live_rows):
        print(draw(plt, args.out).relative_to(ROOT) if args.out == OUT else draw(plt, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
