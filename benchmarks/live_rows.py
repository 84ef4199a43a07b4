"""Live-row kernels against the same kernel on a full buffer, torch.compile and the copy ceiling.

One JSON line per result (``bench``, ``op``, ``variant``, ``rows_live``, ``rows_alloc``, ``us``,
``gbps`` over the fewest bytes the op must move, ``pct_copy`` of the device-to-device copy
measured in the same run). Shapes:

* the per-rank activation shape: 28,672 allocated rows, 32 local experts, A = 128, I = 2,048,
  with 3,072 live rows (96 per expert), every row live (896 per expert), and one expert
  holding every row; ops ``swiglu_fwd``, ``swiglu_bwd``, ``swiglu_quant``;
* DeepSeek-V3's per-rank training shape: counts [21733, 15004, 17982, 10817] (65,536 rows,
  A = 128), H 7,168, I 2,048, T 8,192 tokens × k 8; ops ``swiglu_*`` and ``permute`` (scatter
  into the buffer), ``permute_bwd`` (sum of the k row gradients), ``combine`` (weighted fp32
  sum), ``combine_bwd`` (row gradients + weight gradients).

``--sweep``: also time launch variants (:class:`dropless.ops.swiglu.LaunchConfig`, the row
kernels' block sizes). ``--old DIR``: also time a checkout's ``dropless/ops/triton_kernels.py`` (the kernels before
this file existed) at the same shapes. Needs CUDA and triton; no hydra/wandb.

``--probe [--dump DIR]``: also time the floors at 3,072 live rows (an empty launch, every expert empty, a
copy of the same bytes, torch.compile over a 3,072-row buffer) and write torch.compile's full-buffer kernel under DIR.
Times: :func:`timeit` (median of 200 CUDA-event timings, L2 flushed before each; ``--timing rotate``:
the SwiGLU ops rotate among 8 input sets instead; ``--timing graph``: rotating, 40 calls per CUDA graph,
see ``TIMING``).

Usage: ``python benchmarks/live_rows.py [--old DIR] [--no-compile] [--sweep] [--probe [--dump DIR]]
[--timing flush|rotate|graph] [--only seed|rank|rows]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


_FLUSH = []

#: How :func:`timeit` keeps the inputs out of the L2 cache (``--timing``): ``"flush"`` writes 256 MiB
#: before each call (triton.testing.do_bench's way; the timed call then also pays for evicting those
#: dirty lines, about 50 MB of writes, which dominates a call that moves little); ``"rotate"`` gives
#: each call the next of several input sets (METHOD.md's way), so the call finds its inputs in HBM and
#: the cache holds only other calls' rows, as in a training step; ``"graph"`` rotates the same way with 40
#: calls captured in one CUDA graph, timed per replay (:func:`graph_time`): no host launch or event per
#: call, as when the layer runs captured (only the SwiGLU ops; the others keep the flush).
TIMING = "flush"


def graph_time(calls, per_graph: int = 40, reps: int = 20) -> float:
    """Median microseconds per call when ``per_graph`` calls (cycling through ``calls``) are captured in
    one CUDA graph and the graph is replayed (``TIMING="graph"``, METHOD.md's timer for short launches):
    the kernels run back to back as in a captured layer, so the host's launch and the events' own
    overhead are spread over ``per_graph`` calls instead of added to each."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(per_graph):
            calls[i % len(calls)]()
    for _ in range(3):
        g.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        torch.cuda._sleep(100_000)
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return 1e3 * sorted(a.elapsed_time(b) for a, b in ev)[reps // 2] / per_graph


def timeit(fn, reps: int = 200, sets=None) -> float:
    """Median microseconds of ``reps`` timed calls (CUDA events around each call; a 50 µs device sleep
    before each lets the host queue the call first, so the host's launch time is not what is timed).

    ``sets=None``: ``fn()`` with the L2 flushed before each call. With ``sets`` (a list of argument
    tuples): ``fn(*sets[i])``; under ``TIMING="flush"`` always the first set with the flush, under
    ``"rotate"`` the sets in turn and no flush (pass enough sets that one turn touches several times the
    L2's 50 MB)."""
    rotate = sets is not None and TIMING in ("rotate", "graph")
    calls = [lambda: fn()] if sets is None else [(lambda s=s: fn(*s)) for s in (sets if rotate else sets[:1])]
    if TIMING == "graph" and sets is not None:
        return graph_time(calls)
    if not rotate and not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    for i in range(max(5, len(calls))):
        calls[i % len(calls)]()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i, (a, b) in enumerate(ev):
        if not rotate:
            _FLUSH[0].zero_()
        torch.cuda._sleep(100_000)
        a.record()
        calls[i % len(calls)]()
        b.record()
    torch.cuda.synchronize()
    return 1e3 * sorted(a.elapsed_time(b) for a, b in ev)[reps // 2]


def load_file(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def copy_gbps() -> float:
    a = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    us = timeit(lambda: b.copy_(a))
    return 2 * a.numel() / us / 1e3


def layout_for(counts, A, M):
    from dropless.layout import ExpertLayout

    return ExpertLayout.from_counts(torch.tensor(counts, device="cuda"), A, capacity=M)


# (schedule, block_m, block_n, num_warps, programs_per_sm) variants timed with --sweep
_FWD = [("flat", 4, 1024, 4, 32), ("flat", 1, 2048, 8, 16), ("flat", 1, 1024, 4, 16), ("flat", 2, 2048, 8, 8),
        ("flat", 1, 1024, 4, 32), ("expert", 4, 1024, 4, 16),
        # one resident wave and multiples of it (sm_90a: 52 registers at 4x1024, 4 warps -> 9 programs per
        # SM; 32 registers at 2x1024 / 1x1024, 4 warps -> 16; 1x2048, 8 warps -> 8)
        ("flat", 4, 1024, 4, 9), ("flat", 4, 1024, 4, 18), ("flat", 4, 1024, 4, 64), ("flat", 2, 1024, 4, 32),
        ("flat", 1, 1024, 4, 48), ("flat", 1, 2048, 8, 8), ("flat", 1, 2048, 8, 24)]
SWEEP = {"swiglu_fwd": _FWD, "swiglu_bwd": _FWD[:3], "swiglu_quant": _FWD[:3]}


def swiglu_suite(tag, M, I, layouts, copy, old, compile_, sweep, n_sets=1):
    """The SwiGLU ops at ``M`` rows × ``I`` over each layout, the dense path and torch.compile's; ``n_sets``
    input sets ``(h13, dout, row_w)`` for ``TIMING="rotate"``."""
    from dropless.ops import swiglu as sw

    torch.manual_seed(0)
    dt = torch.bfloat16
    sets = [(torch.randn(M, 2 * I, device="cuda", dtype=dt), torch.randn(M, I, device="cuda", dtype=dt),
             torch.rand(M, device="cuda")) for _ in range(n_sets if TIMING in ("rotate", "graph") else 1)]
    h13, dout, rw = sets[0]
    esz = 2

    def t(fn):
        return timeit(fn, sets=sets)

    def line(op, variant, live, us, bytes_, **kw):
        gbps = bytes_ / us / 1e3
        emit(bench=tag, op=op, variant=variant, rows_live=live, rows_alloc=M, I=I, us=round(us, 2),
             gbps=round(gbps, 1), pct_copy=round(100 * gbps / copy, 1), timing=TIMING, **kw)

    per_row = {"swiglu_fwd": 3 * I * esz, "swiglu_bwd": 5 * I * esz, "swiglu_quant": 2 * I * esz + I + 4 * I // 128}
    for name, lay in layouts.items():
        live = int(lay.counts.sum())
        line("swiglu_fwd", f"new:{name}", live, t(lambda h, d, w: sw.swiglu_fwd(h, lay)), live * per_row["swiglu_fwd"])
        line("swiglu_bwd", f"new:{name}", live, t(lambda h, d, w: sw.swiglu_bwd(h, d, lay)),
             live * per_row["swiglu_bwd"])
        line("swiglu_quant", f"new:{name}", live, t(lambda h, d, w: sw.swiglu_quant(h, lay)),
             live * per_row["swiglu_quant"])
        if old is not None:
            ok, ol = old
            olay = ol.ExpertLayout(lay.counts, lay.start, lay.end, lay.capacity, lay.alignment)
            line("swiglu_fwd", f"old:{name}", live, t(lambda h, d, w: ok.swiglu_fwd(h, olay)),
                 live * per_row["swiglu_fwd"])
            line("swiglu_bwd", f"old:{name}", live, t(lambda h, d, w: ok.swiglu_bwd(h, d, olay)),
                 live * per_row["swiglu_bwd"])
            line("schedule", f"old:tiles:{name}", live, timeit(lambda: olay.tiles(64)), 1)
        if sweep:
            mask = lay.live_mask()
            for op, cfgs in SWEEP.items():
                ref = None
                for c in cfgs:
                    cfg = sw.LaunchConfig(*c)
                    fn = {"swiglu_fwd": lambda h, d, w: sw.swiglu_fwd(h, lay, config=cfg),
                          "swiglu_bwd": lambda h, d, w: sw.swiglu_bwd(h, d, lay, config=cfg),
                          "swiglu_quant": lambda h, d, w: sw.swiglu_quant(h, lay, config=cfg)[0].view(torch.uint8)}[op]
                    got = fn(*sets[0])[mask]
                    ref = got if ref is None else ref  # every variant does the same arithmetic per element
                    line(op, f"new:{name}:" + ",".join(map(str, c)), live, t(fn), live * per_row[op],
                         equal_to_first=bool(torch.equal(got, ref)))
    line("swiglu_fwd", "new:dense", M, t(lambda h, d, w: sw.swiglu_fwd(h)), M * per_row["swiglu_fwd"])
    line("swiglu_bwd", "new:dense", M, t(lambda h, d, w: sw.swiglu_bwd(h, d)), M * per_row["swiglu_bwd"])
    line("swiglu_bwd", "new:dense+row_w", M, t(lambda h, d, w: sw.swiglu_bwd(h, d, None, w)),
         M * per_row["swiglu_bwd"])
    line("swiglu_quant", "new:dense", M, t(lambda h, d, w: sw.swiglu_quant(h)), M * per_row["swiglu_quant"])
    if compile_:
        f = torch.compile(lambda h: torch.nn.functional.silu(h[:, :I]) * h[:, I:])
        line("swiglu_fwd", "torch.compile:dense", M, t(lambda h, d, w: f(h)), M * per_row["swiglu_fwd"])
        b = torch.compile(lambda h, d: sw.swiglu_bwd_torch(h, d))
        line("swiglu_bwd", "torch.compile:dense", M, t(lambda h, d, w: b(h, d)), M * per_row["swiglu_bwd"])
        q = torch.compile(lambda h: sw.quant_fp8_torch(sw.swiglu_fwd_torch(h.float())))
        line("swiglu_quant", "torch.compile:dense", M, t(lambda h, d, w: q(h)), M * per_row["swiglu_quant"])


def rows_suite(tag, counts, A, T, k, H, copy, old, compile_, sweep):
    from dropless.ops import rows as rw

    saved, saved_g = (rw.COMBINE_BWD_BLOCK_H, rw.COMBINE_BWD_WARPS), (rw.BLOCK_H, rw.NUM_WARPS)
    torch.manual_seed(0)
    dt = torch.bfloat16
    lay = layout_for(counts, A, sum(counts) + (len(counts) - 1) * (A - 1))
    M, R = lay.capacity, sum(counts)
    assert R == T * k
    live_rows = torch.nonzero(lay.live_mask()).squeeze(1)
    dest = live_rows[torch.randperm(R, device="cuda")].view(T, k)
    src = torch.full((M,), -1, dtype=torch.int64, device="cuda")
    src[dest.reshape(-1)] = torch.arange(T, device="cuda").repeat_interleave(k)
    x = torch.randn(T, H, device="cuda", dtype=dt)
    y = torch.randn(M, H, device="cuda", dtype=dt)
    g = torch.randn(T, H, device="cuda", dtype=dt)
    w = torch.rand(T, k, device="cuda")
    e = 2

    def line(op, variant, us, bytes_):
        gbps = bytes_ / us / 1e3
        emit(bench=tag, op=op, variant=variant, T=T, k=k, H=H, rows_live=R, rows_alloc=M, us=round(us, 2),
             gbps=round(gbps, 1), pct_copy=round(100 * gbps / copy, 1))

    line("permute", "new:scatter", timeit(lambda: rw.scatter_rows(x, dest, M)), (T + R) * H * e)
    line("permute", "torch:index_select", timeit(lambda: rw.gather_rows(x, src)), (T + R) * H * e)
    line("permute_bwd", "new", timeit(lambda: rw.gather_sum(y, dest, None)), (T + R) * H * e)
    line("combine", "new", timeit(lambda: rw.gather_sum(y, dest, w)), (T + R) * H * e)
    line("combine_bwd", "new", timeit(lambda: rw.combine_bwd(g, y, dest, w, M, True)), (T + 2 * R) * H * e)
    line("combine_bwd", "new:no_grad_w", timeit(lambda: rw.combine_bwd(g, None, dest, w, M, False)), (T + R) * H * e)
    if old is not None:
        ok, _ = old
        line("permute_bwd", "old", timeit(lambda: ok.gather_sum(y, dest, None)), (T + R) * H * e)
        line("combine", "old", timeit(lambda: ok.gather_sum(y, dest, w)), (T + R) * H * e)
        line("combine_bwd", "old", timeit(lambda: ok.combine_bwd(g, y, dest, w, M, True)), (T + 2 * R) * H * e)
    if sweep:
        for bh, nw in ((256, 4), (512, 4), (1024, 4), (1024, 8), (2048, 8)):
            rw.COMBINE_BWD_BLOCK_H, rw.COMBINE_BWD_WARPS = bh, nw
            line("combine_bwd", f"new:BLOCK_H={bh},warps={nw}", timeit(lambda: rw.combine_bwd(g, y, dest, w, M, True)),
                 (T + 2 * R) * H * e)
        rw.COMBINE_BWD_BLOCK_H, rw.COMBINE_BWD_WARPS = saved
        for bh, nw in ((512, 4), (1024, 8), (2048, 8)):
            rw.BLOCK_H, rw.NUM_WARPS = bh, nw
            line("permute", f"new:scatter:BLOCK_H={bh},warps={nw}", timeit(lambda: rw.scatter_rows(x, dest, M)),
                 (T + R) * H * e)
            line("combine", f"new:BLOCK_H={bh},warps={nw}", timeit(lambda: rw.gather_sum(y, dest, w)), (T + R) * H * e)
        rw.BLOCK_H, rw.NUM_WARPS = saved_g
    if compile_:
        c = torch.compile(lambda y_, d, w_: (y_[d].float() * w_.unsqueeze(-1)).sum(1).to(y_.dtype))
        line("combine", "torch.compile", timeit(lambda: c(y, dest, w)), (T + R) * H * e)


def probe(M, I, e, A, copy, dump):
    """Where the time of the live-row SwiGLU goes at 3,072 live rows: the floors (an empty launch, the
    kernel over a layout with every expert empty, a copy of the same bytes, torch.compile's kernel on a
    dense 3,072-row buffer), and torch.compile's full-buffer kernel source (written under ``dump``)."""
    import triton

    from dropless.ops import swiglu as sw

    @triton.jit
    def _empty(p):
        pass

    dt = torch.bfloat16
    live = 3072
    h13 = torch.randn(M, 2 * I, device="cuda", dtype=dt)
    small = torch.randn(live, 2 * I, device="cuda", dtype=dt)
    nbytes = live * 3 * I * 2

    def line(what, us, bytes_=0):
        gbps = bytes_ / us / 1e3
        emit(bench="probe", what=what, us=round(us, 2), gbps=round(gbps, 1), pct_copy=round(100 * gbps / copy, 1))

    dummy = torch.empty(1, device="cuda")
    for g in (1056, 2112):
        line(f"empty_triton_launch:grid={g}", timeit(lambda: _empty[(g,)](dummy)))
    empty = layout_for([0] * e, A, M)
    for c in SWEEP["swiglu_fwd"][:3]:
        cfg = sw.LaunchConfig(*c)
        line("swiglu_fwd:every_expert_empty:" + ",".join(map(str, c)), timeit(lambda: sw.swiglu_fwd(h13, empty,
                                                                                                 config=cfg)))
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    line("copy_same_bytes", timeit(lambda: dst.copy_(src)), nbytes)
    line("swiglu_fwd:dense_3072_rows", timeit(lambda: sw.swiglu_fwd(small)), nbytes)
    f = torch.compile(lambda h: torch.nn.functional.silu(h[:, :I]) * h[:, I:])
    line("torch.compile:dense_3072_rows", timeit(lambda: f(small)), nbytes)
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    g = torch.compile(lambda h: torch.nn.functional.silu(h[:, :I]) * h[:, I:])
    _, codes = run_and_get_code(g, h13)
    line("torch.compile:full_buffer", timeit(lambda: g(h13)), M * 3 * I * 2)
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, "inductor_swiglu_fwd.py"), "w") as fh:
            fh.write("\n\n# ----\n\n".join(codes))
    for code in codes:
        for ln in code.splitlines():
            if any(k in ln for k in ("@triton", "def triton_", "XBLOCK", "num_warps", "eviction", "tl.load",
                                     "tl.store", "grid", "xnumel =")):
                print("INDUCTOR|", ln.strip()[:200], flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", default=None, help="a checkout whose dropless/ops/triton_kernels.py to time too")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time launch variants")
    p.add_argument("--only", choices=["seed", "rank", "rows"], default=None)
    p.add_argument("--probe", action="store_true", help="also time the floors at 3,072 rows, dump torch.compile's code")
    p.add_argument("--dump", default=None, help="where --probe writes torch.compile's kernel source")
    p.add_argument("--timing", choices=["flush", "rotate", "graph"], default="flush",
                   help="keep the SwiGLU inputs out of L2 by a 256 MiB write before each call, or by rotating "
                        "among input sets; graph: rotating, 40 calls captured in one CUDA graph (see TIMING)")
    a = p.parse_args(argv)
    global TIMING
    TIMING = a.timing
    if not torch.cuda.is_available():
        print("benchmarks/live_rows.py needs a CUDA device", file=sys.stderr)
        return 2
    old = None
    if a.old:
        ok = load_file("old_triton_kernels", os.path.join(a.old, "dropless/ops/triton_kernels.py"))
        ol = load_file("old_layout", os.path.join(a.old, "dropless/layout.py"))
        old = (ok, ol)
    copy = copy_gbps()
    emit(bench="copy_ceiling", gbps=round(copy, 1), device=torch.cuda.get_device_name())
    compile_ = not a.no_compile
    if a.probe:
        probe(28672, 2048, 32, 128, copy, a.dump)
    if a.only in (None, "seed"):
        M, e, A, I = 28672, 32, 128, 2048
        layouts = {"live3072": layout_for([96] * e, A, M), "full": layout_for([M // e] * e, A, M),
                   "one_expert": layout_for([M] + [0] * (e - 1), A, M)}
        swiglu_suite("seed_activation", M, I, layouts, copy, old, compile_, a.sweep, n_sets=8)
    counts = [21733, 15004, 17982, 10817]
    if a.only in (None, "rank"):
        lay = layout_for(counts, 128, sum(counts) + 3 * 127)
        swiglu_suite("rank_activation", lay.capacity, 2048, {"rank": lay}, copy, old, compile_, False, n_sets=2)
    if a.only in (None, "rows"):
        rows_suite("rank_rows", counts, 128, 8192, 8, 7168, copy, old, compile_, a.sweep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
