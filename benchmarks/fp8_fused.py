"""FP8 experts with the quantisation fused into the row kernels, against the separate passes and bf16.

One JSON line per measurement (``bench`` names it), each with ``device``. Variants (``variant``),
run in the same process on the same inputs:

* ``bf16``: ``gemm=torch``;
* ``fp8_separate``: ``gemm=fp8`` with ``Fp8Backend(fused_quant=False)``: FC1's landed rows and
  FC2's output gradient each quantised in a pass of their own;
* ``fp8_fused``: ``gemm=fp8`` (``Fp8Backend(fused_quant=True)``, the default): the local gather writes FC1's
  codes as it lands the rows, the combine's backward writes FC2's output-gradient codes
  (dropless/ops/fp8_fused_rows.py).

Measurements:

* ``experts_rows``: DeepSeek-V3's per-rank shape (docs/design.md#a-worked-rank): live rows
  ``[21733, 15004, 17982, 10817]`` of 4 experts, H 7,168, I 2,048, each row one token landed by
  the ``local`` dispatcher (a shuffled order, routing weight not folded), the experts, and the
  combine: forward+backward ms, ``speedup`` over bf16. The row movement is in the timing
  because the fused quantisation lives there.
* ``experts_only``: the same experts on landed rows (no gather, no combine: FC1 and FC2's
  output gradient quantised separately on the FP8 path), bf16 vs ``fp8``: the GEMMs' own gain.
* ``whole_layer``: the MoE layer, T 8,192, H 7,168, I 2,048, E 32, k 8, ``n_group`` 8,
  ``topk_group`` 4, one shared expert (``local`` dispatcher): forward+backward ms, ``speedup``.
* ``crossover``: each expert GEMM of :mod:`dropless.ops.fp8_policy` (FC1, FC2, both data gradients,
  the weight gradient in FP8) alone, bf16 vs FP8, over 64 … 16,384 rows per expert (``--crossover-shapes``:
  H, I and the number of experts, default 7,168 × 2,048 × 4; A 128), and per GEMM the ``min_rows`` for
  fp8_policy's crossover table.
* ``quant_kernels``: the quantisation kernels over a 28,672-row buffer (H 7,168, A 128, 4 experts) with
  3,072 live rows, then every row live (``rows_live``): ``quant_rows`` with the layout (``quant_rows_live``)
  and without (``quant_rows_full_buffer``: every row of the buffer); the landing gather without and with the
  codes (``scatter_rows`` / ``scatter_quant_rows``); the combine's backward of one choice per token
  (``k`` 1, no weight gradient: the a2a dispatcher's) without codes (``combine_bwd``), writing them
  (``combine_bwd_quant``) and followed by the separate pass instead (``combine_bwd_then_quant_rows``:
  what ``fused_quant=False`` runs); the same three with ``k`` 8 choices per token and the routing
  weights' gradient (``need_gw``: the local dispatcher's; ``combine_bwd``, ``combine_bwd_quant_k``,
  ``combine_bwd_k_then_quant_rows``); ``quant_token_blocks`` (the FP8 weight gradient's operand).
  ``group`` 0 (one scale per row) / 128 (1x128) / null (no codes); ``impl`` "new" (this checkout) or
  "old" (``--old DIR``: DIR's copies of fp8_quant.py and fp8_fused_rows.py, e.g. another revision's, timed
  in the same process on the same inputs); ``us`` the median time, ``gbps`` over the bytes the op must
  move on live rows (bf16 in/out 2 bytes, codes 1 byte, a 4-byte scale per row or per 128 columns, the
  combined rows ``y`` read once for the weight gradient). ``--sweep`` adds ``quant_sweep`` lines: launch
  variants of the row quantiser over live rows (``row_block``: rows, warps, programs per SM of
  ``fp8_quant.ROW_BLOCK_WIDE``; of the 1x128 one, ``group_block``: rows, columns, warps, programs per SM
  of ``fp8_quant.GROUP_BLOCK``) and of the combine's tile without a weight gradient (``combine_tile``:
  ``fp8_fused_rows.COMBINE_QUANT_TILE``). ``copy_rows`` (a copy of the live rows, ``x.clone()``) gives the
  copy bandwidth at this size, the yardstick of the others' ``gbps``. On the CPU under
  ``TRITON_INTERPRET=1`` the kernels run in Triton's interpreter (``--smoke``).

Expert weights are drawn on the device; their FP8 copies are made once and cached for every
timed step, as for the micro-batches of one optimizer step. Times: median of CUDA-event timings
after warm-up (``--smoke``: wall clock on the CPU, the emulated FP8 backend, tiny shapes, to
check the script end to end).

Usage: ``python benchmarks/fp8_fused.py [--only experts_rows,experts_only,whole_layer,quant_kernels,crossover]
[--alignment 128] [--ue8m0] [--old DIR] [--sweep] [--smoke] | python benchmarks/stamp.py >>
benchmarks/results/fp8_fused.jsonl``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import torch

from dropless import ModelArgs
from dropless.dispatch.local import LocalDispatcher
from dropless.experts import GroupedExperts
from dropless.layout import ExpertLayout
from dropless.moe import MoE
from dropless.ops import fp8_fused_rows as ff
from dropless.ops import fp8_quant as fq
from dropless.ops import select
from dropless.ops.fp8_backend import Fp8Backend
from dropless.ops.fp8_rows import RowQuantiser
from dropless.ops.rows import combine_bwd, scatter_rows

SEED_COUNTS = [21733, 15004, 17982, 10817]
VARIANTS = ("bf16", "fp8_separate", "fp8_fused")
MEASUREMENTS = ("experts_rows", "experts_only", "whole_layer", "quant_kernels", "crossover")


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def bench(fn, device: torch.device, warmup: int = 5, iters: int = 20) -> float:
    """Median milliseconds of ``fn()``: CUDA events on a GPU, wall clock on the CPU (1 warm-up, 3 timed: a
    smoke check, not a measurement)."""
    if device.type != "cuda":
        warmup, iters = 1, 3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def backend(variant: str, device: torch.device, ue8m0: bool):
    """The GEMM backend of a variant (the emulated FP8 GEMM on the CPU)."""
    if variant == "bf16":
        return "torch"
    return Fp8Backend(emulate=device.type != "cuda", ue8m0=ue8m0, fused_quant=variant == "fp8_fused")


def row_quantiser(be) -> RowQuantiser | None:
    """What :meth:`dropless.moe.MoE._row_quantiser` gives the ``local`` dispatcher for this backend."""
    if not isinstance(be, Fp8Backend):
        return None
    return RowQuantiser(lambda x: be.quant_act(x, None), torch.bfloat16,
                        group=be.act_group if be.fused_quant else None, ue8m0=be.ue8m0)


def _experts(be, counts, H, I, device) -> GroupedExperts:
    ex = GroupedExperts(H, I, len(counts), gemm=be).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0.0, 0.02)
    return ex


def experts_rows(variant, counts, H, I, A, device, ue8m0, base=None) -> dict:
    """Landing gather + experts + combine, forward+backward, at the per-rank shape."""
    g = torch.Generator(device="cpu").manual_seed(0)
    e, R = len(counts), sum(counts)
    idx = torch.cat([torch.full((c,), i) for i, c in enumerate(counts)])[torch.randperm(R, generator=g)]
    idx_R1 = idx.unsqueeze(1).to(device)
    w_R1 = torch.rand(R, 1, generator=g).to(device)
    x = torch.randn(R, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(R, H, device=device, dtype=torch.bfloat16)
    be = backend(variant, device, ue8m0)
    ex = _experts(be, counts, H, I, device)
    disp, quant = LocalDispatcher(e), row_quantiser(ex.backend)
    params = [x, *ex.parameters()]
    kw = {} if quant is None else {"quant": quant}

    def fwdbwd():
        for p in params:
            p.grad = None
        d = disp.dispatch(x, idx_R1, w_R1, alignment=A, **kw)
        y = ex(d.rows_MH, d.layout, fp8_rows=d.fp8)
        disp.combine(y, d.handle).backward(gy)

    ms = bench(fwdbwd, device)
    line = dict(bench="experts_rows", variant=variant, counts=counts, H=H, I=I, alignment=A, ue8m0=ue8m0,
                fwdbwd_ms=round(ms, 3), fwdbwd_tflops=round(18 * R * H * I / ms / 1e9, 1))
    if base is not None:
        line["speedup"] = round(base["fwdbwd_ms"] / ms, 3)
    emit(device=device.type, **line)
    return line


def experts_only(variant, counts, H, I, A, device, ue8m0, base=None) -> dict:
    """The experts on landed rows (no row movement), forward+backward."""
    layout = ExpertLayout.from_counts(torch.tensor(counts, device=device), A, num_rows=sum(counts))
    ex = _experts(backend(variant, device, ue8m0), counts, H, I, device)
    x = torch.randn(layout.capacity, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(layout.capacity, H, device=device, dtype=torch.bfloat16)
    params = [x, *ex.parameters()]

    def fwdbwd():
        for p in params:
            p.grad = None
        ex(x, layout).backward(gy)

    ms = bench(fwdbwd, device)
    R = sum(counts)
    line = dict(bench="experts_only", variant=variant, counts=counts, H=H, I=I, alignment=A, ue8m0=ue8m0,
                fwdbwd_ms=round(ms, 3), fwdbwd_tflops=round(18 * R * H * I / ms / 1e9, 1))
    if base is not None:
        line["speedup"] = round(base["fwdbwd_ms"] / ms, 3)
    emit(device=device.type, **line)
    return line


def whole_layer(variant, T, H, I, E, k, A, device, ue8m0, base=None) -> dict:
    """The MoE layer (``local`` dispatcher, one shared expert), forward+backward."""
    args = ModelArgs(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k,
                     n_group=min(8, E), topk_group=min(4, E), n_shared_experts=1, routed_scaling_factor=2.5,
                     aux_loss_alpha=1e-4, expert_alignment=A, gemm="torch")
    with torch.device(device):  # the parameters made on the device (no host copy of the experts' weights)
        moe = MoE(args, 0)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, args.initializer_range)
        moe.router.e_score_correction_bias.zero_()
    moe = moe.to(torch.bfloat16).train()
    moe.experts.backend = backend(variant, device, ue8m0)
    x = torch.randn(1, T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(1, T, H, device=device, dtype=torch.bfloat16)
    params = [x, *moe.parameters()]

    def fwdbwd():
        for p in params:
            p.grad = None
        moe(x).backward(gy)

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    ms = bench(fwdbwd, device, warmup=3, iters=10)
    fwd = 6 * T * k * H * I + 6 * T * H * I + 2 * T * E * H  # routed + shared + router (live FLOPs)
    line = dict(bench="whole_layer", variant=variant, T=T, H=H, I=I, E=E, k=k, alignment=A, ue8m0=ue8m0,
                fwdbwd_ms=round(ms, 3), fwdbwd_tflops=round(3 * fwd / ms / 1e9, 1))
    if device.type == "cuda":
        line["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if base is not None:
        line["speedup"] = round(base["fwdbwd_ms"] / ms, 3)
    emit(device=device.type, **line)
    return line


def load_kernels(folder: str) -> tuple:
    """``(fp8_quant, fp8_fused_rows)`` modules from ``folder`` (another revision's copies of
    dropless/ops/fp8_quant.py and fp8_fused_rows.py), loaded beside this checkout's under other names; their
    imports of the rest of ``dropless`` resolve to this checkout."""
    mods = []
    for name in ("fp8_quant", "fp8_fused_rows"):
        spec = importlib.util.spec_from_file_location(f"_other_{name}", os.path.join(folder, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods.append(mod)
    return tuple(mods)


#: quant_kernels --sweep: the one-scale-per-row launch over live rows (fp8_quant.ROW_BLOCK_WIDE: rows,
#: warps, programs per SM) and the tile of the combine's backward without a weight gradient
#: (fp8_fused_rows.COMBINE_QUANT_TILE), each timed beside the default
#: (a few programs per SM: each loops over many rows, the persistent form)
SWEEP_ROW_BLOCK = [(1, 8, 32), (1, 8, 16), (1, 8, 8), (1, 8, 4), (1, 8, 2), (1, 4, 32), (1, 4, 8), (1, 4, 4),
                   (1, 16, 8), (1, 16, 2), (2, 8, 16), (2, 8, 4)]
SWEEP_COMBINE_TILE = [1024, 2048, 4096]
#: quant_kernels --sweep: the 1x128 launch (fp8_quant.GROUP_BLOCK: rows, columns, warps, programs per SM)
SWEEP_GROUP_BLOCK = [(4, 1024, 4, 32), (8, 1024, 8, 16), (2, 2048, 8, 16), (1, 8192, 8, 8), (16, 128, 4, 32),
                     (32, 128, 4, 16), (64, 128, 8, 8), (16, 256, 4, 16), (8, 512, 4, 16), (32, 256, 8, 8)]


def quant_kernels(M, live_counts, H, A, device, ue8m0, k=8, old=None, sweep=False) -> None:
    """The quantisation kernels over live rows vs the whole buffer; ``gbps`` over the live bytes. ``old``: another
    revision's ``(fp8_quant, fp8_fused_rows)`` (:func:`load_kernels`), timed beside this checkout's on the same
    inputs (``impl`` "old" / "new")."""
    impls = {"new": (fq, ff)}
    if old is not None:
        impls["old"] = old
    for live_rows in (sum(live_counts), None):  # 3,072 live rows, then every row live
        counts = live_counts if live_rows else _fill(M, len(live_counts), A)
        layout = ExpertLayout.from_counts(torch.tensor(counts, device=device), A, capacity=M)
        n = sum(counts)
        x_MH = torch.randn(M, H, device=device, dtype=torch.bfloat16)
        # one token per live row, landed in a shuffled order; padding rows named by no token
        rows_n = layout.live_mask().nonzero().squeeze(1)[torch.randperm(n, device=device)]
        dest = rows_n.unsqueeze(1)
        src = torch.full((M,), -1, dtype=torch.int64, device=device)
        src[rows_n] = torch.arange(n, device=device)
        x_NH = torch.randn(n, H, device=device, dtype=torch.bfloat16)
        w_N1 = torch.rand(n, 1, device=device)
        # k choices per token (the local dispatcher's combine, with the routing weights' gradient)
        t = n // k
        dest_k = rows_n[:t * k].view(t, k)
        g_TH = torch.randn(t, H, device=device, dtype=torch.bfloat16)
        w_Tk = torch.rand(t, k, device=device)
        row_b = H * 2
        common = dict(ue8m0=ue8m0, rows_live=n, rows_alloc=M, H=H, alignment=A)

        def timed(op, fn, nbytes, group, impl=None, **kw):
            ms = bench(fn, device, warmup=3, iters=20)
            emit(device=device.type, bench="quant_kernels", op=op, group=group, impl=impl, **common, **kw,
                 us=round(ms * 1e3, 1), gbps=round(nbytes / ms / 1e6, 1))

        # the copy bandwidth at this size: the live rows read and written once (torch's copy kernel)
        timed("copy_rows", lambda: x_NH.clone(), n * 2 * row_b, None)
        # the kernels without codes (rows.py's), timed once
        timed("scatter_rows", lambda: scatter_rows(x_NH, dest, M), n * 2 * row_b, None)
        timed("combine_bwd", lambda: combine_bwd(x_NH, None, dest, w_N1, M, False), n * 2 * row_b, None, k=1,
              need_gw=False)
        timed("combine_bwd", lambda: combine_bwd(g_TH, x_MH, dest_k, w_Tk, M, True), t * row_b + 2 * t * k * row_b,
              None, k=k, need_gw=True)
        for group in (0, 128):
            sb = 4 * (H // 128) if group else 4
            codes_b = n * (H + sb)
            for impl, (q_mod, f_mod) in impls.items():
                ops = {
                    "quant_rows_live": (lambda: q_mod.quant_rows(x_MH, layout, ue8m0, group=group),
                                        n * row_b + codes_b, {}),
                    "quant_rows_full_buffer": (lambda: q_mod.quant_rows(x_MH, None, ue8m0, group=group),
                                               n * row_b + codes_b, {}),
                    "scatter_quant_rows": (lambda: f_mod.scatter_quant_rows(x_NH, src, dest, group, ue8m0),
                                           n * 2 * row_b + codes_b, {}),
                    # FC2's output-gradient codes: the combine's backward writing them, against rows.py's
                    # combine backward followed by the separate pass over the live rows it wrote
                    "combine_bwd_quant": (lambda: f_mod.combine_bwd_quant(x_NH, None, dest, w_N1, M, False, group,
                                                                          ue8m0), n * 2 * row_b + codes_b,
                                          dict(k=1, need_gw=False)),
                    "combine_bwd_then_quant_rows": (
                        lambda: q_mod.quant_rows(combine_bwd(x_NH, None, dest, w_N1, M, False)[0], layout, ue8m0,
                                                 group=group), n * 2 * row_b + codes_b, dict(k=1, need_gw=False)),
                    "combine_bwd_quant_k": (lambda: f_mod.combine_bwd_quant(g_TH, x_MH, dest_k, w_Tk, M, True,
                                                                            group, ue8m0),
                                            t * row_b + 2 * t * k * row_b + t * k * (H + sb),
                                            dict(k=k, need_gw=True)),
                    "combine_bwd_k_then_quant_rows": (
                        lambda: q_mod.quant_rows(combine_bwd(g_TH, x_MH, dest_k, w_Tk, M, True)[0], layout, ue8m0,
                                                 group=group), t * row_b + 2 * t * k * row_b + t * k * (H + sb),
                        dict(k=k, need_gw=True)),
                }
                if group == 0 and A % fq.TOKEN_BLOCK == 0:  # the FP8 weight gradient's operand (alignment 128)
                    ops["quant_token_blocks"] = (lambda: q_mod.quant_token_blocks(x_MH, layout, ue8m0),
                                                 n * row_b + n * H + 4 * H * -(-n // fq.TOKEN_BLOCK), {})
                for op, (fn, nbytes, kw) in ops.items():
                    timed(op, fn, nbytes, group, impl, **kw)
        if sweep:
            _sweep(x_MH, x_NH, dest, w_N1, layout, M, H, device, ue8m0, common)


def _sweep(x_MH, x_NH, dest, w_N1, layout, M, H, device, ue8m0, common) -> None:
    """Launch variants of this checkout's kernels (bench ``quant_sweep``); the module constants are restored."""
    n = common["rows_live"]
    row_b, saved = H * 2, (fq.ROW_BLOCK_WIDE, ff.COMBINE_QUANT_TILE, fq.GROUP_BLOCK)
    try:
        for cfg in SWEEP_GROUP_BLOCK:
            fq.GROUP_BLOCK = cfg
            ms = bench(lambda: fq.quant_rows(x_MH, layout, ue8m0, group=128), device, warmup=3, iters=20)
            emit(device=device.type, bench="quant_sweep", op="quant_rows_live", group=128, group_block=list(cfg),
                 **common, us=round(ms * 1e3, 1), gbps=round(n * (row_b + H + 4 * (H // 128)) / ms / 1e6, 1))
        fq.GROUP_BLOCK = saved[2]
        for cfg in SWEEP_ROW_BLOCK:
            fq.ROW_BLOCK_WIDE = cfg
            ms = bench(lambda: fq.quant_rows(x_MH, layout, ue8m0), device, warmup=3, iters=20)
            emit(device=device.type, bench="quant_sweep", op="quant_rows_live", group=0, row_block=list(cfg),
                 **common, us=round(ms * 1e3, 1), gbps=round(n * (row_b + H + 4) / ms / 1e6, 1))
        fq.ROW_BLOCK_WIDE = saved[0]
        for tile in SWEEP_COMBINE_TILE:
            ff.COMBINE_QUANT_TILE = tile
            for group in (0, 128):
                ms = bench(lambda: ff.combine_bwd_quant(x_NH, None, dest, w_N1, M, False, group, ue8m0), device,
                           warmup=3, iters=20)
                sb = 4 * (H // 128) if group else 4
                emit(device=device.type, bench="quant_sweep", op="combine_bwd_quant", group=group, k=1,
                     combine_tile=tile, **common, us=round(ms * 1e3, 1),
                     gbps=round(n * (2 * row_b + H + sb) / ms / 1e6, 1))
    finally:
        fq.ROW_BLOCK_WIDE, ff.COMBINE_QUANT_TILE, fq.GROUP_BLOCK = saved


#: The experts' GEMMs as fp8_policy names them: (K, N) of ``[m, K] @ [K, N]`` in terms of H, I, and whether
#: the fused FP8 path can take the left operand already quantised where it is made (the landing gather for
#: FC1, the SwiGLU for FC2, the combine's backward for FC2's data gradient); FC1's data gradient and the
#: FP8 weight gradient always quantise in a pass of their own
CROSSOVER_GEMMS = {"fc1": (("H", "2I"), True), "fc2": (("I", "H"), True), "fc2_dgrad": (("H", "I"), True),
                   "fc1_dgrad": (("2I", "H"), False), "wgrad": (("H", "2I"), False)}


def _routing_onto(layout: ExpertLayout, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src_M, dest_Nk)`` of ``live // k`` tokens of ``k`` choices each onto ``layout``'s live rows, in a random
    order (the rows left over are live with no token: the GEMM reads them, no row kernel writes them)."""
    live = torch.nonzero(layout.live_mask()).flatten()
    n = live.numel() // k
    g = torch.Generator(device="cpu").manual_seed(0)
    dest = live[torch.randperm(live.numel(), generator=g).to(live.device)[: n * k]].view(n, k).to(device)
    src = torch.full((layout.capacity,), -1, dtype=torch.int64, device=device)
    src[dest.flatten()] = torch.arange(n, device=device).repeat_interleave(k)
    return src, dest


def _producers(name, layout, K, k, fp8, device):
    """``(bf16, fp8)`` callables making the GEMM's left operand ``[M, K]`` as the fused FP8 path makes it: the
    unfused row kernel (bf16 rows) and the kernel that writes the codes and scales too (``(rows or None,
    codes, scales)``): FC1, the ``local`` landing with the rows kept (FC1's weight gradient reads them); FC2,
    the SwiGLU of ``h13 [M, 2K]``; FC2's data gradient, the combine's backward with the routing weights'
    gradient (weights not folded)."""
    from dropless.ops.rows import land_rows
    from dropless.ops.swiglu import swiglu_fwd

    M, bf = layout.capacity, torch.bfloat16
    src, dest = _routing_onto(layout, k, device)
    n = dest.shape[0]
    if name == "fc1":
        x = torch.randn(n, K, device=device, dtype=bf)
        return (lambda: land_rows(x, src, dest),
                lambda: ff.scatter_quant_rows(x, src, dest, fp8.act_group, fp8.ue8m0, keep_rows=True))
    if name == "fc2":
        h13 = torch.randn(M, 2 * K, device=device, dtype=bf)
        return lambda: swiglu_fwd(h13, layout), lambda: (None, *fp8.swiglu_quant_act(h13, layout))
    g = torch.randn(n, K, device=device, dtype=bf)
    y = torch.randn(M, K, device=device, dtype=bf)
    w = torch.rand(n, k, device=device, dtype=torch.float32)
    return (lambda: combine_bwd(g, y, dest, w, M, True)[0],
            lambda: _drop_grad_w(ff.combine_bwd_quant(g, y, dest, w, M, True, fp8.act_group, fp8.ue8m0)))


def _drop_grad_w(out):
    grad_y, _, codes, scales = out
    return grad_y, codes, scales


def crossover(H, I, e, A, sizes, device, ue8m0, k=8) -> None:
    """Per GEMM of fp8_policy, bf16 vs FP8 over rows per expert; one line per size and one ``crossover`` line
    per GEMM and ``quant``: ``min_rows`` = the smallest size from which FP8 is at least as fast at every larger
    size tried (None: never), the value for fp8_policy's table.

    What is timed is the GEMM with the kernel that makes its left operand, the same kernel on both sides
    where there is one: ``separate``, bf16 against the FP8 GEMM plus the quantisation pass of that operand
    (what ``gemm=fp8`` runs with ``fused_quant=False`` and on the recompute nodes); ``in_kernel``, the bf16
    row kernel (landing gather, SwiGLU, combine backward; ``k`` choices per token) + bf16 GEMM against the
    fused row kernel that writes the codes too + FP8 GEMM, so a fused kernel slower than the plain one counts
    against FP8. The FP8 weight gradient (``wgrad="fp8"``) counts both operands' passes."""
    from dropless.ops.torch_backend import TorchBackend

    dims = {"H": H, "I": I, "2I": 2 * I}
    bf16 = TorchBackend()
    fp8 = Fp8Backend(emulate=device.type != "cuda", ue8m0=ue8m0, wgrad="fp8")
    for name, ((kd, nd), in_kernel) in CROSSOVER_GEMMS.items():
        K, N = dims[kd], dims[nd]
        w = torch.randn(e, K, N, device=device, dtype=torch.bfloat16) * 0.02
        quants = ("separate", "in_kernel") if in_kernel else ("separate",)
        faster = {q: [] for q in quants}
        for m in sizes:
            layout = ExpertLayout.from_counts(torch.full((e,), m, device=device), A, num_rows=e * m)
            x = torch.randn(layout.capacity, K, device=device, dtype=torch.bfloat16)
            if name == "wgrad":
                dy = torch.randn(layout.capacity, N, device=device, dtype=torch.bfloat16)
                ms_b = bench(lambda: bf16.gmm_wgrad(x, dy, layout), device, warmup=3, iters=10)
                times = {"separate": bench(lambda: fp8.gmm_wgrad(x, dy, layout), device, warmup=3, iters=10)}
            else:
                b, bs = fp8.weight(w)
                ms_b = bench(lambda: bf16.gmm(x, w, layout), device, warmup=3, iters=10)
                times = {"separate": bench(lambda: fp8.gmm(x, w, layout), device, warmup=3, iters=10)}
                if in_kernel:
                    make_b, make_q = _producers(name, layout, K, k, fp8, device)
                    ms_b = bench(lambda: bf16.gmm(make_b(), w, layout), device, warmup=3, iters=10)
                    times["separate"] += bench(make_b, device, warmup=3, iters=10)

                    def fused():
                        _, q, qs = make_q()
                        return fp8.scaled_gmm(q, qs, b, bs, layout)

                    times["in_kernel"] = bench(fused, device, warmup=3, iters=10)
            for qn, ms_f in times.items():
                faster[qn].append(ms_f <= ms_b)
                emit(device=device.type, bench="crossover_point", gemm=name, quant=qn, rows_per_expert=m, experts=e,
                     K=K, N=N, k=k, alignment=A, bf16_us=round(ms_b * 1e3, 1), fp8_us=round(ms_f * 1e3, 1),
                     speedup=round(ms_b / ms_f, 3))
        for qn, fast in faster.items():
            min_rows = next((sizes[i] for i in range(len(sizes)) if all(fast[i:])), None)
            emit(device=device.type, bench="crossover", gemm=name, quant=qn, H=H, I=I, experts=e, k=k,
                 alignment=A, ue8m0=ue8m0, sizes=sizes, min_rows=min_rows)


def _fill(M: int, e: int, A: int) -> list[int]:
    """Counts of ``e`` experts filling an ``M``-row buffer with alignment ``A`` (every row live)."""
    per = (M // e) // A * A
    return [per] * (e - 1) + [M - per * (e - 1)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(MEASUREMENTS), help=f"comma-separated subset of {MEASUREMENTS}")
    p.add_argument("--alignment", type=int, default=128, help="expert_alignment (a multiple of 16)")
    p.add_argument("--ue8m0", action="store_true", help="power-of-two scales")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, runs on the CPU too (checks the script)")
    p.add_argument("--old", metavar="DIR", help="quant_kernels: also time the fp8_quant.py and fp8_fused_rows.py "
                   "in DIR (another revision's copies) on the same inputs")
    p.add_argument("--sweep", action="store_true", help="quant_kernels: also time launch variants (quant_sweep)")
    p.add_argument("--crossover-shapes", default="7168x2048x4",
                   help="comma-separated HxI, HxIxE or HxIxExk (hidden x moe_intermediate x local experts x "
                        "choices per token; E default 4, k 8) shapes for the crossover measurement")
    a = p.parse_args(argv)
    only = a.only.split(",")
    unknown = sorted(set(only) - set(MEASUREMENTS))
    if unknown:
        p.error(f"--only: unknown {unknown}; choose from {MEASUREMENTS}")
    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not a.smoke:
        p.error("needs a CUDA device (FP8 tensor cores); --smoke runs tiny shapes on the CPU")
    torch.manual_seed(0)
    if a.smoke:
        counts, H, I, T, E, k, M, live, A = [40, 24, 0, 17], 256, 128, 32, 16, 2, 512, [48, 16, 0, 32], 16
    else:
        counts, H, I, T, E, k, M, live, A = SEED_COUNTS, 7168, 2048, 8192, 32, 8, 28672, [1024, 768, 1280, 0], \
            a.alignment
    if "experts_rows" in only:
        base = None
        for v in VARIANTS:
            line = experts_rows(v, counts, H, I, A, device, a.ue8m0, base)
            base = base or line
    if "experts_only" in only:
        base = None
        for v in ("bf16", "fp8_separate"):
            line = experts_only(v, counts, H, I, A, device, a.ue8m0, base)
            base = base or line
    if "whole_layer" in only:
        base = None
        for v in VARIANTS:
            line = whole_layer(v, T, H, I, E, k, A, device, a.ue8m0, base)
            base = base or line
    if "quant_kernels" in only:
        old = load_kernels(a.old) if a.old else None
        forced = select.FORCE_TRITON
        # on the CPU under Triton's interpreter (TRITON_INTERPRET=1) the kernels themselves run
        select.FORCE_TRITON = forced or (device.type != "cuda" and select.HAS_TRITON and select.interpreting())
        try:
            # --smoke: alignment 128 as the real shape's (the FP8 weight gradient's operand needs it)
            quant_kernels(M, live, H, 128 if a.smoke else A, device, a.ue8m0, old=old, sweep=a.sweep)
        finally:
            select.FORCE_TRITON = forced
    if "crossover" in only:
        sizes = [16, 64] if a.smoke else [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
        shapes = ([(H, I, len(counts), k)] if a.smoke else
                  [(*(int(v) for v in s.split("x")), 4, 8)[:4] if s.count("x") == 1 else
                   (*(int(v) for v in s.split("x")), 8)[:4] for s in a.crossover_shapes.split(",")])
        for ch, ci, ce, ck in shapes:
            crossover(ch, ci, ce, 128, sizes, device, a.ue8m0, ck)
    emit(device=device.type, bench="wall", only=only, seconds=round(time.perf_counter() - t0, 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
