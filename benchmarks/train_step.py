"""Training-step benchmark: one JSON line per variant.

For a recipe (default ``h200_single``) and each variant (``eager``, ``compile``: ``train.compile=true``,
``compile_moe``: also ``train.compile_moe=true``; each with ``+graph``: also ``train.cuda_graph=true``, the
warm-up then at least the graph's eager micro-batches and its capture, so every timed step replays)
it builds a :class:`~dropless.train.trainer.Trainer` with ``logging.mode=disabled``, no validation
and no checkpoints, runs ``--warmup`` steps, then ``--steps`` timed steps (pipelined by
:meth:`~dropless.train.trainer.Trainer.iter_steps` as ``Trainer.train`` runs them; the trainer's own
``tokens_per_s``, ``mfu`` and ``tflops``: wall time between two steps' metric reads; medians
reported), then ``--profile-steps`` steps under :mod:`torch.profiler`, whose kernel (CUDA) or
operator (CPU) self times are summed per category:

``casts_copies``  copy / cast / cat / fill kernels (the bf16 refresh's foreach copy included)
``optimizer``     ``multi_tensor_apply`` / fused and foreach AdamW, norm and clip kernels
``dense_gemm``    cuBLAS / CUTLASS / nvjet GEMMs and ``aten::mm``-like ops that are not grouped
``grouped_gemm``  grouped GEMMs (``_grouped_mm``, CUTLASS grouped kernels) and the Triton wgrad
``softmax_ce``    softmax, log-softmax, NLL / cross-entropy
``attention``     SDPA (flash, cuDNN, efficient attention)
``sort_index_topk`` sort, top-k, index, gather, scatter, cub/radix kernels
``other``         everything else (elementwise, reductions, the Triton SwiGLU and combine, ...)

Fields: ``variant``, ``recipe``, ``device``, ``tokens_per_s``, ``mfu``, ``tflops``,
``step_ms`` (median), ``peak_mem_gib`` (``torch.cuda.max_memory_allocated`` from the first step
on, the build excluded; or the CPU peak RSS), ``steady_peak_mem_gib`` and ``warmup_peak_mem_gib``
(CUDA: the peak over the timed, profiled and ``--copies`` steps, and over the warm-up steps, where
compilation and a CUDA graph's capture happen; None on CPU, and both None with ``--steps 0``),
``peak_reserved_gib`` (CUDA ``max_memory_reserved`` over the timed steps: what the caching allocator and a
graph's pool held),
``resident_at_start_gib`` (CUDA memory still allocated when the variant started: an earlier
variant's leftovers, 0 when nothing leaked),
``losses`` (every step's training loss, warm-up first), ``expert_load_max_over_mean`` (the median
over the timed steps of the MoE layers' mean ``expert_load/*/max_over_mean``, the largest expert's
rows over the mean: the weight gradients' time depends on it, and a freshly initialised router
sends nearly every token to the same experts, up to ``E/k``; None without MoE layers),
``kernel_ms_per_step`` (per
category), ``kernel_ms_total_per_step``, ``kernels_per_step`` (launch count), ``build_s``
(construction, compile excluded: compilation happens in the first steps), ``overrides``;
with ``--top-kernels N`` also ``top_kernels`` (``[ms per step, calls per step, name]``), with
``--label`` a ``label``; on CUDA also where the GPU sits idle between kernels, in which phase of the
step and after which operator's launch (``gpu_busy_ms_per_step``, ``gpu_idle_ms_per_step``,
``idle_host_bound_ms_per_step``, ``idle_gaps_per_step``, ``idle_by_phase``, ``idle_top``:
:func:`idle_gaps`); ``--copies FILE`` also writes, from one more step profiled with shapes and
stacks, every copy-like operator with its shapes, dtypes, count and the dropless line that issued
it (:func:`copy_listing`).

Usage::

    python -m benchmarks.train_step                                  # h200_single, eager + compile
    python -m benchmarks.train_step --variants eager --steps 50      # e.g. the first 50 losses
    python -m benchmarks.train_step --set model.recompute_fc1=true --set train.activation_checkpointing=true
    python -m benchmarks.train_step --recipe cpu_default --set train.seq_len=32 --warmup 1 --steps 2
    python -m benchmarks.train_step --variants eager --set gemm=fp8 --fp8-separate-quant
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from dropless.ops.backends import register_backend
from dropless.ops.fp8_backend import Fp8Backend

CATEGORIES = ("casts_copies", "optimizer", "dense_gemm", "grouped_gemm", "softmax_ce", "attention",
              "sort_index_topk", "other")

_RULES = (  # first match wins; matched against the lower-cased kernel / operator name (attention first:
    # cuDNN's SDPA kernels are named ..._wgmma_..., which the grouped-GEMM key "gmm" would take)
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn", "attn")),
    ("grouped_gemm", ("grouped", "groupproblem", "_grouped_mm", "gmm", "wgrad")),
    ("softmax_ce", ("softmax", "cross_entropy", "nll_loss", "logsumexp")),
    ("casts_copies", ("copy", "cast", "catarray", "aten::cat", "_to_copy", "aten::to", "convert")),
    # not "fused_": inductor names every kernel triton_*_fused_*
    ("optimizer", ("multi_tensor_apply", "adam", "_foreach", "foreach")),
    ("dense_gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
                    "aten::matmul", "aten::linear", "sm90_", "sm80_", "ampere_")),
    ("sort_index_topk", ("sort", "radix", "topk", "index", "gather", "scatter", "cub::", "bitonic", "argmax")),
)


def category(name: str) -> str:
    """The category of a kernel or operator name (the table of docs/performance.md#the-training-step)."""
    n = name.lower()
    for cat, keys in _RULES:
        if any(k in n for k in keys):
            return cat
    return "other"


def counted_device_time_us(ev: Any) -> float:
    """An averaged profiler event's own GPU time (µs) to count, 0 for what is not a kernel or copy.

    A ``record_function`` range that reaches the GPU (``torch.optim``'s
    ``Optimizer.step#AdamW.step``) shows as a CUDA "user annotation" spanning the kernels it
    launched: counting it too would count the optimizer's kernels twice.
    """
    if ev.device_type != torch.autograd.DeviceType.CUDA or getattr(ev, "is_user_annotation", False):
        return 0.0
    us = getattr(ev, "self_device_time_total", None)
    return float(ev.self_cuda_time_total if us is None else us)


#: the device-side event categories of a Kineto chrome trace (what occupies the GPU)
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: the host-side launch categories (their ``correlation`` names the device event they launched)
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def _containing(starts: list[float], spans: list[tuple[float, float, str]], t: float, walk: int = 256) -> str | None:
    """The name of the latest-starting span of ``spans`` (sorted by start; ``starts`` their
    starts) that contains ``t``: for properly nested spans, the innermost one."""
    i = bisect.bisect_right(starts, t) - 1
    for j in range(i, max(-1, i - walk), -1):
        s, e, name = spans[j]
        if e > t:
            return name
    return None


def idle_gaps(trace: dict[str, Any], steps: int, min_gap_us: float = 1.0, top: int = 15) -> dict[str, Any]:
    """Where the GPU waits, from a Kineto chrome trace (``prof.export_chrome_trace``) of ``steps`` steps.

    The device events (kernels, copies, fills) are merged into busy intervals from the first
    one's start to the last one's end; every hole of at least ``min_gap_us`` between them is an
    idle gap. Each gap is charged to the event that ends it: to the ``dropless.*`` range of the
    trainer (:meth:`~dropless.train.trainer.Trainer.train_step`'s ``record_function`` phases,
    ``(no phase)`` outside them) in which the host *launched* that event, and to the operator that
    launched it (the outermost operator of the launching thread at that moment, and the innermost,
    i.e. the one whose ``External id`` the event carries). A gap whose ending event was launched
    after the previous busy interval ended is the GPU waiting for the host (``host_bound``); the
    rest are the device's own launch latency.

    Returns:
        ``gpu_busy_ms_per_step`` (the span less the gaps), ``gpu_idle_ms_per_step`` (the gaps),
        ``idle_host_bound_ms_per_step``,
        ``idle_gaps_per_step`` (their count), ``idle_by_phase`` (ms per step), ``idle_top``:
        ``[ms per step, gaps per step, phase, outer operator, launching operator]``, the largest first.
    """
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    dev = sorted((e for e in evs if e.get("cat") in _DEVICE_CATS), key=lambda e: float(e["ts"]))
    out: dict[str, Any] = {"gpu_busy_ms_per_step": 0.0, "gpu_idle_ms_per_step": 0.0,
                           "idle_host_bound_ms_per_step": 0.0, "idle_gaps_per_step": 0.0, "idle_by_phase": {},
                           "idle_top": []}
    if not dev:
        return out
    launch = {e["args"]["correlation"]: e for e in evs
              if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
    ext = {e["args"]["External id"]: e["name"] for e in evs
           if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    phases = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in evs
                    if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("dropless."))
    phase_starts = [p[0] for p in phases]
    ops_by_tid: dict[Any, list[tuple[float, float, str]]] = {}
    for e in evs:
        if e.get("cat") == "cpu_op":
            t0 = float(e["ts"])
            ops_by_tid.setdefault(e.get("tid"), []).append((t0, t0 + float(e["dur"]), e["name"]))
    outer: dict[Any, tuple[list[float], list[tuple[float, float, str]]]] = {}
    for tid, ops in ops_by_tid.items():  # the top-level operators of each thread: disjoint, sorted
        ops.sort(key=lambda x: (x[0], -x[1]))
        tops, end = [], float("-inf")
        for o in ops:
            if o[0] >= end:
                tops.append(o)
                end = o[1]
        outer[tid] = ([o[0] for o in tops], tops)

    busy = idle = host = 0.0
    n_gaps = 0
    by_phase: dict[str, float] = {}
    groups: dict[tuple[str, str, str], list[float]] = {}
    cur_start, cur_end = float(dev[0]["ts"]), float(dev[0]["ts"]) + float(dev[0]["dur"])
    for e in dev[1:]:
        s, d = float(e["ts"]), float(e["dur"])
        gap = s - cur_end
        if gap >= min_gap_us:
            busy += cur_end - cur_start
            idle += gap
            n_gaps += 1
            args = e.get("args", {})
            ln = launch.get(args.get("correlation"))
            lt = float(ln["ts"]) if ln is not None else s
            if ln is not None and lt >= cur_end:
                host += gap
            phase = _containing(phase_starts, phases, lt) or "(no phase)"
            tid = ln.get("tid") if ln is not None else None
            top_op = _containing(*outer[tid], lt) if tid in outer else None
            key = (phase, top_op or "?", ext.get(args.get("External id"), "?"))
            g = groups.setdefault(key, [0.0, 0])
            g[0] += gap
            g[1] += 1
            by_phase[phase] = by_phase.get(phase, 0.0) + gap
            cur_start = s
        cur_end = max(cur_end, s + d)
    busy += cur_end - cur_start
    n = max(1, steps)
    out.update(gpu_busy_ms_per_step=round(busy / 1e3 / n, 3), gpu_idle_ms_per_step=round(idle / 1e3 / n, 3),
               idle_host_bound_ms_per_step=round(host / 1e3 / n, 3), idle_gaps_per_step=round(n_gaps / n, 1),
               idle_by_phase={k: round(v / 1e3 / n, 3) for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])})
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    out["idle_top"] = [[round(v[0] / 1e3 / n, 3), round(v[1] / n, 1), *k] for k, v in rows]
    return out


def _profile(trainer, steps: int, top: int = 0) -> dict[str, Any]:
    """Per-step self time per category (ms) and launches, over ``steps`` profiled steps
    (and the ``top`` kernels / operators by time: ``[ms per step, calls per step, name]``);
    on CUDA also where the GPU sits idle (:func:`idle_gaps`)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.env.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in trainer.iter_steps(trainer.step + steps):  # pipelined, as Trainer.train runs them
            pass
        if cuda:
            torch.cuda.synchronize()
    per = dict.fromkeys(CATEGORIES, 0.0)
    launches = 0
    rows = []
    for ev in prof.key_averages():
        if cuda:
            us = counted_device_time_us(ev)
            if not us:
                continue
            launches += ev.count
        else:
            us = ev.self_cpu_time_total
            if not ev.key.startswith("aten::") or not us:
                continue
            launches += ev.count
        per[category(ev.key)] += us / 1e3
        rows.append((round(us / 1e3 / steps, 3), ev.count // steps, ev.key[:160]))
    per = {k: round(v / steps, 3) for k, v in per.items()}
    out = {"kernel_ms_per_step": per, "kernel_ms_total_per_step": round(sum(per.values()), 3),
           "kernels_per_step": launches // steps}
    if cuda:
        with tempfile.TemporaryDirectory() as td:
            path = f"{td}/trace.json"
            prof.export_chrome_trace(path)
            with open(path) as f:
                out.update(idle_gaps(json.load(f), steps))
    if top:
        out["top_kernels"] = [list(r) for r in sorted(rows, reverse=True)[:top]]
    return out


#: the operators :func:`copy_listing` reports (a copy, cast, concatenation, gather, fill or large add)
COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::index_select", "aten::gather", "aten::clone",
            "aten::contiguous", "aten::index", "aten::add_", "aten::add", "aten::zero_", "aten::fill_",
            "aten::stack", "aten::_foreach_copy_", "aten::_foreach_mul_")
_ADD_OPS = ("aten::add_", "aten::add")


def _numel(shape: Any) -> int:
    n = 1
    for d in shape or ():
        n *= int(d)
    return n


_DROPLESS_FRAME = re.compile(r"(?:^|/)(dropless/\S+\(\d+\): \S+)")


def _dropless_frames(ev: Any, n: int = 2) -> list[str]:
    """The innermost ``n`` dropless Python functions above ``ev`` in the profiler's tree
    (``with_stack``: Python calls are events named ``path(first line): function``)."""
    out, p = [], ev.cpu_parent
    while p is not None and len(out) < n:
        m = _DROPLESS_FRAME.search(p.name)
        if m:
            out.append(m.group(1))
        p = p.cpu_parent
    return out


def _in_backward(ev: Any) -> bool:
    p = ev.cpu_parent
    while p is not None:
        if p.name.startswith("autograd::engine::evaluate_function: "):
            return True
        p = p.cpu_parent
    return False


def _origin(ev: Any, fwd_frames: dict[int, list[str]]) -> str:
    """Where ``ev`` was issued: the innermost dropless functions above it (``a < b``: ``a``
    called from ``b``); for an op run by autograd's engine, the backward node and the dropless
    functions of the forward op that made it (linked by sequence number)."""
    own = _dropless_frames(ev)
    node = ev
    while node is not None and not node.name.startswith("autograd::engine::evaluate_function: "):
        node = node.cpu_parent
    if node is None:
        return " < ".join(own) if own else "(outside dropless)"
    fn = node.name.split(": ", 1)[1]
    fwd = fwd_frames.get(node.sequence_nr)
    return (f"backward {fn}" + (f" (of {' < '.join(fwd)})" if fwd else "")
            + (f" in {' < '.join(own)}" if own else ""))


def copy_listing(trainer: Any, min_add_numel: int = 1 << 16) -> list[dict[str, Any]]:
    """One training step under :mod:`torch.profiler` (``record_shapes``, ``with_stack``): every
    top-level copy-like operator (:data:`COPY_OPS`; an op inside another listed op is not counted
    again; adds only from ``min_add_numel`` output elements), grouped by (op, input shapes,
    dtypes, origin): ``{"op", "shapes", "dtypes", "origin", "count", "cpu_ms", "bytes"}``, the
    largest ``bytes`` (count × first input's elements × 4, a size rank, not a traffic count) first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.env.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, record_shapes=True, with_stack=True) as prof:
        trainer.train_step()
        if cuda:
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    fwd_frames: dict[int, list[str]] = {}
    # the forward op that created each autograd node: every op reports the number the next node
    # will get, and the op that creates it is the last to report it before it is incremented
    for e in sorted(events, key=lambda x: x.time_range.start):
        if e.sequence_nr < 0 or e.name.startswith("autograd::") or _in_backward(e):
            continue
        fr = _dropless_frames(e)
        if fr:
            fwd_frames[e.sequence_nr] = fr
    groups: dict[tuple, dict[str, Any]] = {}
    for e in events:
        if e.name not in COPY_OPS:
            continue
        p = e.cpu_parent
        nested = False
        while p is not None:
            if p.name in COPY_OPS:
                nested = True
                break
            p = p.cpu_parent
        if nested:
            continue
        shapes = [list(x) for x in (e.input_shapes or []) if x]
        if e.name in _ADD_OPS and (not shapes or _numel(shapes[0]) < min_add_numel):
            continue
        dtypes = [d for d in (getattr(e, "input_dtypes", None) or []) if d]
        key = (e.name, str(shapes), str(dtypes), _origin(e, fwd_frames))
        g = groups.setdefault(key, {"op": e.name, "shapes": shapes, "dtypes": dtypes, "origin": key[3],
                                    "count": 0, "cpu_ms": 0.0, "bytes": 0})
        g["count"] += 1
        g["cpu_ms"] += e.cpu_time_total / 1e3
        g["bytes"] += (_numel(shapes[0]) if shapes else 0) * 4
    out = sorted(groups.values(), key=lambda g: (-g["bytes"], g["op"]))
    for g in out:
        g["cpu_ms"] = round(g["cpu_ms"], 3)
    return out


def write_copy_listing(rows: list[dict[str, Any]], path: str, header: str = "") -> None:
    """:func:`copy_listing`'s rows as a text table (one line per group)."""
    with open(path, "w") as f:
        if header:
            f.write(header.rstrip() + "\n\n")
        f.write(f"{'count':>5} {'cpu_ms':>8}  {'op':<22} {'shapes / dtypes':<60} origin\n")
        for g in rows:
            sd = f"{g['shapes']} {g['dtypes']}"
            f.write(f"{g['count']:>5} {g['cpu_ms']:>8.3f}  {g['op']:<22} {sd:<60} {g['origin']}\n")


BASE_VARIANTS = ("eager", "compile", "compile_moe")


def run_variant(recipe: str, variant: str, overrides: list[str], warmup: int, steps: int,
                profile_steps: int, top: int = 0, copies: str | None = None) -> dict[str, Any]:
    """Build, warm up, time and profile one variant; returns its JSON record."""
    from dropless.train.config import compose
    from dropless.train.trainer import GRAPH_WARMUP, Trainer

    base, _, extra = variant.partition("+")
    if base not in BASE_VARIANTS or extra not in ("", "graph"):
        raise ValueError(f"variant {variant!r}: one of {BASE_VARIANTS}, optionally with '+graph'")
    if extra == "graph":  # every timed step a replay: the eager warm-up micro-batches and the capture come first
        warmup = max(warmup, GRAPH_WARMUP + 1)
    total = warmup + steps + profile_steps + (1 if copies else 0)
    with tempfile.TemporaryDirectory() as rd:
        ov = [f"recipe={recipe}", "logging.mode=disabled", "logging.progress=false", "train.val_every=0",
              "train.ckpt_every=0", f"train.steps={total}", f"run_dir={rd}/run",
              f"train.compile={'true' if base != 'eager' else 'false'}",
              f"train.compile_moe={'true' if base == 'compile_moe' else 'false'}",
              f"train.cuda_graph={'true' if extra == 'graph' else 'false'}", *overrides]
        # memory still allocated from an earlier variant of this process (0 unless something leaked)
        resident = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        tr = Trainer(compose(ov))
        build_s = time.perf_counter() - t0
        try:
            if tr.env.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(tr.env.device)
            losses, timed = [], []
            warm_peak = None
            if warmup == 0 and tr.env.device.type == "cuda":
                warm_peak = torch.cuda.max_memory_allocated(tr.env.device) / 2**30
            for i, rec in enumerate(tr.iter_steps(warmup + steps)):  # pipelined, as Trainer.train runs them
                losses.append(rec["loss"])
                if i >= warmup:
                    timed.append(rec)
                if i == warmup - 1 and tr.env.device.type == "cuda":  # the warm-up's peak (compilation included)
                    warm_peak = torch.cuda.max_memory_allocated(tr.env.device) / 2**30
                    torch.cuda.reset_peak_memory_stats(tr.env.device)
            prof = _profile(tr, profile_steps, top) if profile_steps > 0 else {}
            if copies:
                rows = copy_listing(tr)
                write_copy_listing(rows, copies, f"copy-like operators of one training step: recipe={recipe} "
                                                 f"variant={variant} device={tr.env.device} overrides={overrides}")
            steady = torch.cuda.max_memory_allocated(tr.env.device) / 2**30 if warm_peak is not None else None
            from dropless.train.metrics import peak_memory_gib

            med = {k: statistics.median(r[k] for r in timed if r[k] is not None) if timed else None
                   for k in ("tokens_per_s", "mfu", "tflops", "step_time_s")}
            loads = [statistics.mean(v for k, v in r.items() if k.endswith("/max_over_mean")) for r in timed
                     if any(k.endswith("/max_over_mean") for k in r)]
            dev = tr.env.device
            return {"bench": "train_step", "variant": variant, "recipe": recipe,
                    "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "tokens_per_s": med["tokens_per_s"], "mfu": med["mfu"], "tflops": med["tflops"],
                    "step_ms": None if med["step_time_s"] is None else med["step_time_s"] * 1e3,
                    "peak_mem_gib": peak_memory_gib(dev) if steady is None else max(steady, warm_peak),
                    "steady_peak_mem_gib": steady, "warmup_peak_mem_gib": warm_peak,
                    "peak_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30 if dev.type == "cuda" else None,
                    "resident_at_start_gib": resident, "losses": losses,
                    "expert_load_max_over_mean": statistics.median(loads) if loads else None,
                    "warmup": warmup, "steps": steps,
                    "profile_steps": profile_steps, "build_s": build_s, "overrides": list(overrides), **prof}
        finally:
            tr.close()
            del tr
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="h200_single")
    p.add_argument("--variants", nargs="+", default=["eager", "compile"],
                   choices=[b + g for b in BASE_VARIANTS for g in ("", "+graph")])
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile happens here)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps after the timed ones (0: none)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override, repeatable (e.g. --set train.micro_batch_size=8)")
    p.add_argument("--top-kernels", type=int, default=0, metavar="N",
                   help="also report the N kernels (operators on CPU) that take the most time (field top_kernels)")
    p.add_argument("--label", default=None, help="a label copied into each record (field label)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--copies", default=None, metavar="FILE",
                   help="after the profiled steps, one more step with shapes and stacks: write every copy-like "
                        "operator (count, shapes, dtypes, the dropless line that issued it) to FILE "
                        "(FILE.<variant> with several variants)")
    p.add_argument("--fp8-separate-quant", action="store_true",
                   help="gemm=fp8 as Fp8Backend(fused_quant=False): FC1's rows and FC2's output gradient each "
                        "quantised in a pass of its own, not by the kernels that write them (field "
                        "fp8_separate_quant)")
    p.add_argument("--fp8-gemms", default=None, metavar="LIST",
                   help="gemm=fp8 with exactly these expert GEMMs in FP8 (comma-separated names of "
                        "dropless.ops.fp8_policy.GEMMS, or 'none'), the others in bf16, in place of the plan the "
                        "crossover table gives (field fp8_gemms): to measure a plan before the table says it")
    a = p.parse_args(argv)
    if a.fp8_separate_quant:
        register_backend("fp8", functools.partial(Fp8Backend, fused_quant=False))
    if a.fp8_gemms is not None:
        force_fp8_plan(a.fp8_gemms)
    for variant in a.variants:
        copies = None if not a.copies else (a.copies if len(a.variants) == 1 else f"{a.copies}.{variant}")
        with contextlib.redirect_stdout(sys.stderr):  # the trainer's own lines: stdout carries only JSON
            rec = run_variant(a.recipe, variant, a.overrides, a.warmup, a.steps, a.profile_steps, a.top_kernels,
                              copies)
        if a.label:
            rec = {"label": a.label, **rec}
        if a.fp8_separate_quant:
            rec["fp8_separate_quant"] = True
        if a.fp8_gemms is not None:
            rec["fp8_gemms"] = a.fp8_gemms
        emit(rec, a.out)
    return 0


def force_fp8_plan(names: str) -> None:
    """Make every MoE layer of this process plan ``names`` (comma-separated GEMMs of ``fp8_policy.GEMMS``, or
    ``none``) in FP8 and the other GEMMs in bf16, whatever the crossover table says (the layer still says
    which run in bf16). Raises SystemExit naming an unknown GEMM."""
    from dropless import moe
    from dropless.ops.fp8_policy import GEMMS, Fp8Plan

    chosen = set() if names == "none" else set(names.split(","))
    if chosen - set(GEMMS):
        raise SystemExit(f"--fp8-gemms: unknown {sorted(chosen - set(GEMMS))}; choose from {GEMMS} or 'none'")
    moe.plan_fp8 = lambda rows, table: Fp8Plan(**{g: g in chosen for g in GEMMS})


def emit(rec: dict[str, Any], out: str | None = None) -> None:
    """Print ``rec`` as one JSON line on stdout and, with ``out``, append it to that file."""
    line = json.dumps(rec)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
