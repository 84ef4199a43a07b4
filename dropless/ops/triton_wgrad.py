"""Triton grouped weight-gradient GEMM with an accumulate epilogue (CUDA, or Triton's interpreter).

* :func:`grouped_wgrad_` — for each local expert ``i`` with live rows
  ``[start[i], end[i])`` of the landed buffer (:class:`~dropless.layout.ExpertLayout`)::

      accumulate=False:  dw[i]  = x[start:end]^T @ dy[start:end]     (an empty expert: exact zeros)
      accumulate=True:   dw[i] += x[start:end]^T @ dy[start:end]     (an empty expert: dw[i] untouched)

  with ``x [M, K]``, ``dy [M, N]`` (bf16, fp16 or fp32; one dtype) and ``dw [e, K, N]``
  (contiguous; fp32, bf16 or fp16), written in place. Products are summed in fp32
  registers; with ``accumulate`` the existing ``dw`` tile is read, added in fp32 and
  stored back in ``dw``'s dtype (a GEMM with ``beta = 1``).
* :func:`fp8_grouped_wgrad_` — the same from e4m3 operands quantised along the rows
  (:func:`dropless.ops.fp8_quant.quant_token_blocks`: ``x^T [K, M']`` and ``dy^T [N, M']``
  row-contiguous, as the FP8 tensor cores read both operands), the rows walked in 128-row
  blocks that start on the layout's (128-aligned) segment starts; block scales are applied to
  each block's product (``promote``), per-expert scales once at the end. The tile order,
  epilogue and tuning are the bf16 kernel's.

One program per (expert, K-tile, N-tile): the experts largest first (:func:`largest_first`, so
that a large expert's long tiles do not run alone at the end), and a grouped order inside each
expert so that the programs in flight share their ``x`` and ``dy`` column blocks in L2. Each program
reads its expert's ``start``/``end`` on the device and walks those rows ``BLOCK_R`` at a
time: ``acc += x_tile^T @ dy_tile`` (bf16/fp16 tensor-core dots; fp32 inputs use IEEE
fp32, no TF32). Only LIVE rows are read: the row loads are masked to ``[start, end)``
with ``other=0``, so padding rows (alignment gaps, the tail after ``end[e-1]``; they may
hold NaN) never reach the result. Row offsets are 64-bit (``M·K`` may pass ``2^31``).
One launch, no host sync (the layout stays on the device), except the one-time tuning
below.

Why it exists: ``torch._grouped_mm`` has no ``out=``/accumulate argument. When a rank's
tokens go through the MoE layer in chunks (``num_token_chunks``), each chunk's weight
gradient would otherwise be a fresh ``[e, K, N]`` buffer that is then added into the
first — a transient as large as the weight gradient itself plus an extra read/write
pass over it. This kernel adds each chunk's contribution in its epilogue instead.

Tuning: on CUDA the tile shape is picked per ``(M's power-of-two class, K, N, x dtype, dw dtype,
accumulate, device)`` by timing a few configs (:data:`CONFIGS`; :data:`FP32_CONFIGS` for fp32 inputs)
on the first call's own operands; that first call syncs the host
(``triton.testing.do_bench``), later ones do not. It is not ``triton.autotune``: that
times the kernel by running it again and again on the caller's tensors, which would add
the gradient in many times over when ``accumulate=True`` (and its ``restore_value`` would
clone the whole ``dw`` on every timed run). Here the timed runs pass ``write=0``: the
epilogue reads and writes every ``dw`` tile as a real run does but adds zero, so ``dw``
keeps its values and no scratch ``dw`` is needed. The epilogue must be in the timing: at
~512 rows per expert it is a third of the kernel's time, and the config fastest without
it is not the fastest with it. The configs of
one input dtype share ``BLOCK_R``, so the rows are summed in the same chunks whichever
wins. Under ``TRITON_INTERPRET=1`` one small config is used and nothing is timed.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from dropless.layout import ExpertLayout

# The tuning candidates on CUDA for bf16/fp16 x and dy (Hopper-sized tiles for wgmma; BLOCK_R is
# the rows per dot step, the same in all of them).
CONFIGS = [
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_R": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_R": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_R": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_R": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 256, "BLOCK_R": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 256, "BLOCK_N": 128, "BLOCK_R": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 256, "BLOCK_R": 64}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_K": 256, "BLOCK_N": 128, "BLOCK_R": 64}, num_warps=8, num_stages=4),
]
# fp32 x and dy: IEEE fp32 dots run on the FMA units, where the tiles above spill heavily.
FP32_CONFIGS = [
    triton.Config({"BLOCK_K": 64, "BLOCK_N": 64, "BLOCK_R": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 64, "BLOCK_R": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 64, "BLOCK_N": 128, "BLOCK_R": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_R": 32}, num_warps=8, num_stages=3),
]
# The single config under Triton's CPU interpreter (small tiles run fast there).
INTERPRET_CONFIG = triton.Config({"BLOCK_K": 32, "BLOCK_N": 32, "BLOCK_R": 16}, num_warps=4, num_stages=1)
# FP8 (e4m3) operands: BLOCK_R is the 128-row scale block of quant_token_blocks in all of them.
FP8_CONFIGS = [
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_R": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_R": 128}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_R": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_K": 128, "BLOCK_N": 256, "BLOCK_R": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_K": 256, "BLOCK_N": 128, "BLOCK_R": 128}, num_warps=8, num_stages=3),
]
FP8_INTERPRET_CONFIG = triton.Config({"BLOCK_K": 32, "BLOCK_N": 32, "BLOCK_R": 128}, num_warps=4, num_stages=1)
_GROUP_K = 8  # K-tiles per group in the program order (L2 reuse of the dy column blocks)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_best_config: dict[tuple, triton.Config] = {}


@triton.jit
def _wgrad_step(acc, x_ptr, dy_ptr, r, row1, offs_k, offs_n, mask_k, mask_n, stride_xm, stride_dym,
                PRECISION: tl.constexpr, BLOCK_R: tl.constexpr):
    """``acc += x[r:r+BLOCK_R, offs_k]^T @ dy[r:r+BLOCK_R, offs_n]``, rows at or past ``row1`` masked to 0."""
    rows = r + tl.arange(0, BLOCK_R)
    live = rows < row1  # rows past end[ex] are padding or the next expert's: never read
    r64 = rows.to(tl.int64)
    xt = tl.load(x_ptr + r64[:, None] * stride_xm + offs_k[None, :], mask=live[:, None] & mask_k[None, :], other=0.0)
    dyt = tl.load(dy_ptr + r64[:, None] * stride_dym + offs_n[None, :], mask=live[:, None] & mask_n[None, :],
                  other=0.0)
    return tl.dot(tl.trans(xt), dyt, acc, input_precision=PRECISION)


@triton.jit
def _tile(pid, order_ptr, start_ptr, end_ptr, K, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
          GROUP_K: tl.constexpr):
    """Program ``pid`` -> its expert, N-tile, the tile's offsets and masks and the expert's rows ``[row0, row1)``.

    The experts in ``order`` (largest first, :func:`largest_first`): the GPU hands out programs
    in ``pid`` order as SMs free up, so the longest tiles start first and the short ones fill in
    behind them. Within an expert, GROUP_K K-tiles side by side, then the next N-tile (the
    programs in flight share their dy column blocks in L2)."""
    num_k = tl.cdiv(K, BLOCK_K)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = num_k * num_n
    slot = pid // tiles
    ex = tl.load(order_ptr + slot)
    t = pid - slot * tiles
    width = GROUP_K * num_n
    k0 = (t // width) * GROUP_K
    group_k = tl.minimum(num_k - k0, GROUP_K)
    pid_k = k0 + (t % width) % group_k
    pid_n = (t % width) // group_k
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return ex, pid_n, offs_k, offs_n, offs_k < K, offs_n < N, tl.load(start_ptr + ex), tl.load(end_ptr + ex)


@triton.jit
def _store_tile(acc, dw_ptr, ex, pid_n, offs_k, offs_n, mask_k, mask_n, K, N, write, ACCUMULATE: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """``dw[ex][tile] = acc`` or, with ACCUMULATE, ``+= acc`` (fp32 add, stored in dw's dtype)."""
    dw_row = dw_ptr + ex.to(tl.int64) * K * N + offs_k[:, None].to(tl.int64) * N
    if ACCUMULATE:
        # add the old value in two column halves, so that the old tile and the accumulator do not
        # both sit whole in registers (that spills at 128x256). The tuning runs (write = 0) add 0:
        # the same loads and stores as a real run, with dw left as it was.
        a0, a1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_K, 2, BLOCK_N // 2)), (0, 2, 1)))
        offs_h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        m0 = mask_k[:, None] & (offs_h < N)[None, :]
        a0 = tl.where(write != 0, a0, 0.0) + tl.load(dw_row + offs_h[None, :], mask=m0, other=0.0).to(tl.float32)
        tl.store(dw_row + offs_h[None, :], a0.to(dw_ptr.dtype.element_ty), mask=m0)
        offs_h += BLOCK_N // 2
        m1 = mask_k[:, None] & (offs_h < N)[None, :]
        a1 = tl.where(write != 0, a1, 0.0) + tl.load(dw_row + offs_h[None, :], mask=m1, other=0.0).to(tl.float32)
        tl.store(dw_row + offs_h[None, :], a1.to(dw_ptr.dtype.element_ty), mask=m1)
    else:  # an overwrite: a tuning run writes what the real run writes again
        tl.store(dw_row + offs_n[None, :], acc.to(dw_ptr.dtype.element_ty),
                 mask=mask_k[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["write"])
def _grouped_wgrad_kernel(x_ptr, dy_ptr, dw_ptr, order_ptr, start_ptr, end_ptr, M, K, N, stride_xm, stride_dym,
                          write, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          GROUP_K: tl.constexpr):
    ex, pid_n, offs_k, offs_n, mask_k, mask_n, row0, row1 = _tile(tl.program_id(0), order_ptr, start_ptr, end_ptr,
                                                                  K, N, BLOCK_K, BLOCK_N, GROUP_K)
    row1 = tl.minimum(row1, M)  # counts over the capacity (the dispatcher's device assert reports them): stay inside
    if ACCUMULATE:
        if row1 <= row0:  # empty expert: dw[ex] += 0 -- leave it as it is
            return
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    if INTERPRET:
        # the interpreter keeps scalars as 1-element arrays, which range() rejects under numpy 2
        r = row0
        while r < row1:
            acc = _wgrad_step(acc, x_ptr, dy_ptr, r, row1, offs_k, offs_n, mask_k, mask_n, stride_xm, stride_dym,
                              PRECISION, BLOCK_R)
            r += BLOCK_R
    else:
        for r in range(row0, row1, BLOCK_R):  # a for loop, so that the loads are software-pipelined
            acc = _wgrad_step(acc, x_ptr, dy_ptr, r, row1, offs_k, offs_n, mask_k, mask_n, stride_xm, stride_dym,
                              PRECISION, BLOCK_R)
    _store_tile(acc, dw_ptr, ex, pid_n, offs_k, offs_n, mask_k, mask_n, K, N, write, ACCUMULATE, BLOCK_K, BLOCK_N)


@triton.jit
def _fp8_step(acc, a_ptr, sa_ptr, b_ptr, sb_ptr, r, offs_k, offs_n, mask_k, mask_n, K, N, stride_a, stride_b,
              PROMOTE: tl.constexpr, BLOCK_R: tl.constexpr):
    """One 128-row block: ``acc += (a_blk^T @ b_blk) · (sa[blk] ⊗ sb[blk])`` from e4m3 codes (rows past the
    expert's end are zero codes; the block lies inside the expert's aligned segment). Without PROMOTE
    the codes' product is added unscaled (the scales are per expert, applied once at the end)."""
    # segment starts are multiples of 128; said after the cast (the hint does not survive it), so that the
    # loads along the rows are 16-byte cp.async copies (without it: byte loads, 4x slower on an H200)
    rows = tl.multiple_of(r.to(tl.int64), BLOCK_R) + tl.arange(0, BLOCK_R)
    # aT [K, M'], bT [N, M']: both operands K-major along the rows, as wgmma reads FP8 (the row-major
    # [M', K] codes, transposed in the kernel, ran at half the speed on an H200)
    a = tl.load(a_ptr + offs_k[:, None].to(tl.int64) * stride_a + rows[None, :], mask=mask_k[:, None], other=0.0)
    b = tl.load(b_ptr + offs_n[:, None].to(tl.int64) * stride_b + rows[None, :], mask=mask_n[:, None], other=0.0)
    part = tl.dot(a, tl.trans(b))
    if PROMOTE:
        blk = (r // BLOCK_R).to(tl.int64)
        sa = tl.load(sa_ptr + blk * K + offs_k, mask=mask_k, other=0.0)
        sb = tl.load(sb_ptr + blk * N + offs_n, mask=mask_n, other=0.0)
        return acc + part * (sa[:, None] * sb[None, :])
    return acc + part


@triton.jit(do_not_specialize=["write"])
def _fp8_wgrad_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, dw_ptr, order_ptr, start_ptr, end_ptr, M, K, N, stride_a,
                      stride_b, write, ACCUMULATE: tl.constexpr, PROMOTE: tl.constexpr,
                      INTERPRET: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUP_K: tl.constexpr):
    ex, pid_n, offs_k, offs_n, mask_k, mask_n, row0, row1 = _tile(tl.program_id(0), order_ptr, start_ptr, end_ptr,
                                                                  K, N, BLOCK_K, BLOCK_N, GROUP_K)
    row1 = tl.minimum(row1, M)  # the codes' M' columns: never past them
    if ACCUMULATE:  # row0 is a multiple of BLOCK_R (the layout's alignment)
        if row1 <= row0:
            return
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    if INTERPRET:
        r = row0
        while r < row1:
            acc = _fp8_step(acc, a_ptr, sa_ptr, b_ptr, sb_ptr, r, offs_k, offs_n, mask_k, mask_n, K, N, stride_a,
                            stride_b, PROMOTE, BLOCK_R)
            r += BLOCK_R
    else:
        for r in range(row0, row1, BLOCK_R):
            acc = _fp8_step(acc, a_ptr, sa_ptr, b_ptr, sb_ptr, r, offs_k, offs_n, mask_k, mask_n, K, N, stride_a,
                            stride_b, PROMOTE, BLOCK_R)
    if not PROMOTE:  # per-expert column scales: sa [e, K], sb [e, N]
        sa = tl.load(sa_ptr + ex.to(tl.int64) * K + offs_k, mask=mask_k, other=0.0)
        sb = tl.load(sb_ptr + ex.to(tl.int64) * N + offs_n, mask=mask_n, other=0.0)
        acc = acc * (sa[:, None] * sb[None, :])
    _store_tile(acc, dw_ptr, ex, pid_n, offs_k, offs_n, mask_k, mask_n, K, N, write, ACCUMULATE, BLOCK_K, BLOCK_N)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def largest_first(counts_e: torch.Tensor) -> torch.Tensor:
    """int32 ``[e]``: the local experts by live rows, largest first (ties by index; on the device, no sync).

    Why: a weight-gradient tile's time grows with its expert's rows. When an expert's tiles are
    fewer than the SMs, a schedule in expert order leaves the largest expert's long tiles to run
    alone at the end ; started first, they overlap the short tiles
    (``benchmarks/grouped_gemm.py`` measures both orders)."""
    return torch.argsort(counts_e, descending=True, stable=True).to(torch.int32)


def _launch(cfg: triton.Config, dw_eKN, x_MK, dy_MN, layout, order, accumulate: bool, write: bool) -> None:
    e, k, n = dw_eKN.shape
    bk, bn = cfg.kwargs["BLOCK_K"], cfg.kwargs["BLOCK_N"]
    grid = (e * triton.cdiv(k, bk) * triton.cdiv(n, bn),)
    _grouped_wgrad_kernel[grid](
        x_MK, dy_MN, dw_eKN, order, layout.start, layout.end, x_MK.shape[0], k, n, x_MK.stride(0), dy_MN.stride(0),
        int(write),
        ACCUMULATE=bool(accumulate), PRECISION="ieee" if x_MK.dtype == torch.float32 else None,
        INTERPRET=_interpret(), GROUP_K=_GROUP_K, **cfg.all_kwargs())


def _rows_class(m: int) -> int:
    """The tuning key's row count: ``M``'s power-of-two class. A dispatcher without a static capacity
    (``a2a``) lands a different ``M`` each step; keyed on ``M`` itself, every new one would be
    timed again (a host sync and about a second of timed runs)."""
    return int(m).bit_length()


def _tune(key: tuple, candidates: list, run, what: str) -> triton.Config:
    """The fastest of ``candidates`` for ``key`` (cached): ``run(cfg)`` launches a timed run with ``write=0``."""
    cfg = _best_config.get(key)
    if cfg is None:
        from triton.runtime.errors import OutOfResources, PTXASError
        from triton.testing import do_bench

        best_ms = math.inf
        for cand in candidates:
            try:
                ms = do_bench(lambda c=cand: run(c), warmup=10, rep=50, return_mode="median")
            except (OutOfResources, PTXASError):
                continue
            if ms < best_ms:
                cfg, best_ms = cand, ms
        if cfg is None:
            raise RuntimeError(f"{what}: no tile config compiled for {key}")
        _best_config[key] = cfg
    return cfg


def _pick_config(dw_eKN, x_MK, dy_MN, layout, order, accumulate: bool) -> triton.Config:
    if _interpret():
        return INTERPRET_CONFIG
    k, n = dw_eKN.shape[1:]
    key = (_rows_class(x_MK.shape[0]), k, n, x_MK.dtype, dw_eKN.dtype, bool(accumulate), x_MK.device.index)
    return _tune(key, FP32_CONFIGS if x_MK.dtype == torch.float32 else CONFIGS,
                 lambda c: _launch(c, dw_eKN, x_MK, dy_MN, layout, order, accumulate, write=False),
                 "grouped_wgrad_")


def _check(dw_eKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout) -> None:
    name = "grouped_wgrad_"
    if x_MK.dim() != 2 or dy_MN.dim() != 2 or dw_eKN.dim() != 3:
        raise ValueError(f"{name}: need x [M, K], dy [M, N] and dw [e, K, N]; got x {tuple(x_MK.shape)}, "
                         f"dy {tuple(dy_MN.shape)}, dw {tuple(dw_eKN.shape)}")
    (m, k), (m2, n), (e, k2, n2) = x_MK.shape, dy_MN.shape, dw_eKN.shape
    if m != m2:
        raise ValueError(f"{name}: x has {m} rows but dy has {m2}; both must be the landed buffer's M rows")
    if (k, n) != (k2, n2):
        raise ValueError(f"{name}: dw is [e, K, N] = {tuple(dw_eKN.shape)} but x^T @ dy is [{k}, {n}] "
                         f"(x {tuple(x_MK.shape)}, dy {tuple(dy_MN.shape)}); pass x and dy in that order "
                         f"and dw shaped [e, x.shape[1], dy.shape[1]]")
    if e != layout.num_experts or m != layout.capacity:
        raise ValueError(f"{name}: dw has {e} experts and x {m} rows, but the layout has "
                         f"{layout.num_experts} experts and capacity {layout.capacity}")
    if x_MK.dtype != dy_MN.dtype or x_MK.dtype not in _DTYPES:
        raise ValueError(f"{name}: x and dy must share one dtype of {_DTYPES}; got x {x_MK.dtype} and "
                         f"dy {dy_MN.dtype} (cast one of them)")
    if dw_eKN.dtype not in _DTYPES:
        raise ValueError(f"{name}: dw must be one of {_DTYPES}, got {dw_eKN.dtype}")
    if not dw_eKN.is_contiguous():
        raise ValueError(f"{name}: dw must be contiguous (it is written in place; strides "
                         f"{dw_eKN.stride()}); allocate it contiguous or pass a contiguous buffer and copy back")
    for t, what in ((x_MK, "x"), (dy_MN, "dy")):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: {what} needs unit stride along its last dim (strides {t.stride()}); "
                             f"pass {what}.contiguous()")
    devs = {x_MK.device, dy_MN.device, dw_eKN.device, layout.start.device, layout.end.device}
    if len(devs) != 1:
        raise ValueError(f"{name}: x, dy, dw and the layout must be on one device; got {sorted(map(str, devs))}")
    if x_MK.device.type != "cuda" and not _interpret():
        raise ValueError(f"{name}: needs CUDA tensors (got {x_MK.device}); on the CPU set TRITON_INTERPRET=1 "
                         f"before triton is imported")
    if layout.start.dtype != torch.int32 or layout.end.dtype != torch.int32:
        raise ValueError(f"{name}: layout.start/end must be int32 (build the layout with ExpertLayout.from_counts); "
                         f"got {layout.start.dtype}/{layout.end.dtype}")


def grouped_wgrad_(dw_eKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout,
                   accumulate: bool) -> torch.Tensor:
    """Per-expert weight gradient over live rows, written (or added) into ``dw_eKN`` in place.

    Args:
        dw_eKN: ``[e, K, N]`` contiguous, fp32/bf16/fp16; the output. With ``accumulate=False``
            its old contents are ignored (NaN included); with ``accumulate=True`` they are the
            ``beta = 1`` term.
        x_MK: ``[M, K]`` landed rows (unit stride along K; any row stride); padding rows may hold anything.
        dy_MN: ``[M, N]`` upstream gradient, same dtype as ``x_MK`` (unit stride along N).
        layout: the rows' :class:`~dropless.layout.ExpertLayout` (``e`` experts, capacity ``M``).
        accumulate: add into ``dw_eKN`` (fp32 add, stored in ``dw``'s dtype) instead of overwriting.
    Returns:
        ``dw_eKN``, holding ``x[start_i:end_i]^T @ dy[start_i:end_i]`` (plus its old value when
        ``accumulate``) for each expert ``i``; an empty expert gets exact zeros (or is left as it is).
    Raises:
        ValueError: mismatched shapes/dtypes/devices, a non-contiguous ``dw``, or CPU tensors
            without ``TRITON_INTERPRET=1``.
    """
    _check(dw_eKN, x_MK, dy_MN, layout)
    e, k, n = dw_eKN.shape
    if e == 0 or k == 0 or n == 0:
        return dw_eKN
    order = largest_first(layout.counts)
    cfg = _pick_config(dw_eKN, x_MK, dy_MN, layout, order, accumulate)
    _launch(cfg, dw_eKN, x_MK, dy_MN, layout, order, accumulate, write=True)
    return dw_eKN


def _grouped_wgrad_new(x_MK: torch.Tensor, dy_MN: torch.Tensor, counts: torch.Tensor, start: torch.Tensor,
                      end: torch.Tensor, capacity: int, alignment: int) -> torch.Tensor:
    layout = ExpertLayout(counts=counts, start=start, end=end, capacity=capacity, alignment=alignment)
    dw = x_MK.new_empty(counts.shape[0], x_MK.shape[1], dy_MN.shape[1])
    return grouped_wgrad_(dw, x_MK, dy_MN, layout, accumulate=False)


# as an opaque op for torch.compile (the first call's tuning times the kernel on the host); eager calls launch directly
_grouped_wgrad_op = torch.library.custom_op("dropless::grouped_wgrad", _grouped_wgrad_new, mutates_args=())


@_grouped_wgrad_op.register_fake
def _(x_MK, dy_MN, counts, start, end, capacity, alignment):
    return x_MK.new_empty(counts.shape[0], x_MK.shape[1], dy_MN.shape[1])


def grouped_wgrad(x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """A new ``dw [e, K, N]`` in ``x_MK``'s dtype: :func:`grouped_wgrad_` with ``accumulate=False``.

    Same arguments, rules and errors as :func:`grouped_wgrad_`; under ``torch.compile`` one opaque
    op (``dropless::grouped_wgrad``)."""
    launch = _grouped_wgrad_op if torch.compiler.is_compiling() else _grouped_wgrad_new
    return launch(x_MK, dy_MN, layout.counts, layout.start, layout.end, layout.capacity, layout.alignment)


# ----------------------------------------------------------------------------- FP8 operands
def _launch_fp8(cfg, dw_eKN, a, sa, b, sb, layout, order, accumulate: bool, write: bool, promote: bool) -> None:
    e, k, n = dw_eKN.shape
    grid = (e * triton.cdiv(k, cfg.kwargs["BLOCK_K"]) * triton.cdiv(n, cfg.kwargs["BLOCK_N"]),)
    _fp8_wgrad_kernel[grid](a, sa, b, sb, dw_eKN, order, layout.start, layout.end, a.shape[1], k, n, a.stride(0),
                            b.stride(0), int(write), ACCUMULATE=bool(accumulate), PROMOTE=promote,
                            INTERPRET=_interpret(), GROUP_K=_GROUP_K, **cfg.all_kwargs())


def fp8_grouped_wgrad_(dw_eKN: torch.Tensor, a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor,
                       b_s: torch.Tensor, layout: ExpertLayout, accumulate: bool, promote: bool = True
                       ) -> torch.Tensor:
    """Per-expert weight gradient from e4m3 operands with 128-row block scales, written (or added) into ``dw_eKN``.

    ``dw[i] (+)= x[live_i]^T @ dy[live_i]`` where ``x ≈ a_q · a_s`` and ``dy ≈ b_q · b_s`` as
    :func:`dropless.ops.fp8_quant.quant_token_blocks` makes them: each 128-row block's e4m3
    product is summed in fp32 by the tensor cores, then scaled by the block's column scales
    (``a_s[blk] ⊗ b_s[blk]``) into the fp32 accumulator (DeepSeek-V3 §3.3.2's promotion).

    Args:
        dw_eKN: ``[e, K, N]`` contiguous fp32/bf16/fp16, the output (as :func:`grouped_wgrad_`).
        a_q, a_s: ``x``'s codes ``[K, M']`` (rows contiguous) and scales (see ``promote``).
        b_q, b_s: ``dy``'s codes ``[N, M']`` and scales.
        layout: the rows' layout; its alignment a multiple of 128.
        accumulate: add into ``dw_eKN`` instead of overwriting.
        promote: True: scales per 128-row block (``[M'/128, K]``, ``[M'/128, N]``, as
            :func:`quant_token_blocks` makes them), applied to each block's product. False: one
            scale per expert per column (``[e, K]``, ``[e, N]``, :func:`quant_expert_columns`),
            applied once to the summed product.
    Returns:
        ``dw_eKN``; an empty expert gets exact zeros (or is left as it is with ``accumulate``).
    Raises:
        ValueError: shapes or dtypes that do not match, an alignment not a multiple of 128, a
            non-contiguous ``dw``, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    name = "fp8_grouped_wgrad_"
    e, k, n = dw_eKN.shape if dw_eKN.dim() == 3 else (0, 0, 0)
    mp = -(-layout.capacity // 128) * 128
    want_a, want_b = (k, mp), (n, mp)
    if dw_eKN.dim() != 3 or tuple(a_q.shape) != want_a or tuple(b_q.shape) != want_b:
        raise ValueError(f"{name}: need dw [e, K, N] and codes shaped {want_a} and {want_b} (M' = {mp}, "
                         f"as quant_token_blocks writes them); got dw {tuple(dw_eKN.shape)}, a {tuple(a_q.shape)}, "
                         f"b {tuple(b_q.shape)}")
    rows_s = mp // 128 if promote else e
    if tuple(a_s.shape) != (rows_s, k) or tuple(b_s.shape) != (rows_s, n):
        raise ValueError(f"{name}: scales must be {(rows_s, k)} and {(rows_s, n)} (promote={promote}); "
                         f"got {tuple(a_s.shape)} and {tuple(b_s.shape)}")
    if a_q.dtype != torch.float8_e4m3fn or b_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: codes must be float8_e4m3fn, got {a_q.dtype} and {b_q.dtype}")
    if a_s.dtype != torch.float32 or b_s.dtype != torch.float32:
        raise ValueError(f"{name}: scales must be float32, got {a_s.dtype} and {b_s.dtype}")
    if not (a_q.is_contiguous() and b_q.is_contiguous() and a_s.is_contiguous() and b_s.is_contiguous()):
        raise ValueError(f"{name}: codes and scales must be contiguous (as quant_token_blocks returns them)")
    if layout.alignment % 128 or e != layout.num_experts:
        raise ValueError(f"{name}: the layout (alignment {layout.alignment}, {layout.num_experts} experts) must have "
                         f"an alignment that is a multiple of 128 and dw's {e} experts")
    if dw_eKN.dtype not in _DTYPES or not dw_eKN.is_contiguous():
        raise ValueError(f"{name}: dw must be contiguous fp32/bf16/fp16, got {dw_eKN.dtype}, strides {dw_eKN.stride()}")
    if layout.start.dtype != torch.int32 or layout.end.dtype != torch.int32:
        raise ValueError(f"{name}: layout.start/end must be int32 (build the layout with ExpertLayout.from_counts); "
                         f"got {layout.start.dtype}/{layout.end.dtype}")
    devs = {t.device for t in (dw_eKN, a_q, a_s, b_q, b_s, layout.start, layout.end)}
    if len(devs) != 1:
        raise ValueError(f"{name}: dw, the codes, the scales and the layout must be on one device; got "
                         f"{sorted(map(str, devs))}")
    if a_q.device.type != "cuda" and not _interpret():
        raise ValueError(f"{name}: needs CUDA tensors (got {a_q.device}); on the CPU set TRITON_INTERPRET=1")
    if e == 0 or k == 0 or n == 0:
        return dw_eKN
    order = largest_first(layout.counts)
    if _interpret():
        cfg = FP8_INTERPRET_CONFIG
    else:
        key = ("fp8", _rows_class(mp), k, n, dw_eKN.dtype, bool(accumulate), promote, a_q.device.index)
        cfg = _tune(key, FP8_CONFIGS, lambda c: _launch_fp8(c, dw_eKN, a_q, a_s, b_q, b_s, layout, order, accumulate,
                                                            False, promote), name)
    _launch_fp8(cfg, dw_eKN, a_q, a_s, b_q, b_s, layout, order, accumulate, True, promote)
    return dw_eKN
