"""Triton kernels for the memory-bound steps of the MoE path (CUDA only).

* :func:`swiglu_fwd` / :func:`swiglu_bwd` — ``silu(gate) * up`` over LIVE rows only:
  the grid walks the layout's row tiles (:meth:`ExpertLayout.tiles`), so the work is
  bounded by live rows, not by ``M`` (DESIGN.md rule 3; seed 000 §2-3), and padding
  rows of the outputs stay unwritten. The backward writes ``d(gate)||d(up)`` straight
  into one ``[M, 2I]`` buffer (no concatenation copy).
* :func:`gather_sum` — ``out[n] = Σ_j w[n, j] · rows[dest[n, j]]`` with an fp32
  accumulator in registers, ``j = 0 … k-1`` in fixed order (the combine's forward and
  the permutation's backward). Choices with ``dest < 0`` are skipped, never read.
* :func:`combine_bwd` — for each choice, ``grad_rows[dest] = w · grad_out`` and
  ``grad_w = <grad_out, rows[dest]>`` in one pass.

Each is one launch with no host sync. Used by :mod:`dropless.permute` and
:mod:`dropless.experts` when the tensors are on CUDA and Triton imports.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_kernel(h13_ptr, dout_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, end_ptr, I,
                   stride_h, stride_do, stride_o, BACKWARD: tl.constexpr, HAS_W: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One ``BLOCK_M`` row tile of one expert (masked at its end) × one ``BLOCK_N`` column block.

    Forward: ``out [M, I] = silu(gate) * up``. Backward: ``out [M, 2I] = d gate || d up`` given
    ``dout [M, I]`` (scaled by the row weight ``w [M]`` when ``HAS_W``); ``dout_ptr``/``w_ptr``
    are unused in the forward. Computed in fp32, stored in ``out``'s dtype.
    """
    tile = tl.program_id(0)
    ex = tl.load(tile_expert_ptr + tile)
    if ex < 0:  # a tile past the live rows
        return
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(end_ptr + ex)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < row_end) & (cols[None, :] < I)
    r64 = rows[:, None].to(tl.int64)
    base = h13_ptr + r64 * stride_h + cols[None, :]
    g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + I, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    obase = out_ptr + r64 * stride_o + cols[None, :]
    if BACKWARD:
        do = tl.load(dout_ptr + r64 * stride_do + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_W:  # the routing weight folded into the SwiGLU output: d(out) = d(out · w) · w, in fp32
            w = tl.load(w_ptr + rows, mask=rows < row_end, other=0.0).to(tl.float32)
            do = do * w[:, None]
        dg = do * u * s * (1.0 + g * (1.0 - s))
        du = do * g * s
        tl.store(obase, dg.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(obase + I, du.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(obase, (g * s * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum_kernel(rows_ptr, dest_ptr, w_ptr, out_ptr, H, stride_r, stride_o,
                       K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        d = tl.load(dest_ptr + n * K + j)
        # a choice routed elsewhere is masked: its row is never read. The test is made on a
        # [BLOCK_H] block, not the scalar: Triton 3.9's interpreter turns `block & scalar` into int32
        live = (cols * 0 + d) >= 0
        r = tl.load(rows_ptr + tl.maximum(d, 0).to(tl.int64) * stride_r + cols, mask=cmask & live,
                    other=0.0).to(tl.float32)
        if HAS_W:
            r = r * tl.load(w_ptr + n * K + j).to(tl.float32)
        acc += r
    tl.store(out_ptr + n.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _combine_bwd_kernel(grad_ptr, rows_ptr, dest_ptr, w_ptr, grad_rows_ptr, grad_w_ptr, H,
                        stride_g, stride_r, stride_gr, K: tl.constexpr, NEED_GW: tl.constexpr,
                        BLOCK_H: tl.constexpr, NUM_HB: tl.constexpr):
    n = tl.program_id(0)
    for j in tl.static_range(K):
        d = tl.load(dest_ptr + n * K + j)
        d64 = tl.maximum(d, 0).to(tl.int64)
        w = tl.load(w_ptr + n * K + j).to(tl.float32)
        dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        for hb in tl.static_range(NUM_HB):
            cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            m = (cols < H) & ((cols * 0 + d) >= 0)  # block-shaped test, as in _gather_sum_kernel
            g = tl.load(grad_ptr + n.to(tl.int64) * stride_g + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(grad_rows_ptr + d64 * stride_gr + cols, (g * w).to(grad_rows_ptr.dtype.element_ty), mask=m)
            if NEED_GW:
                y = tl.load(rows_ptr + d64 * stride_r + cols, mask=m, other=0.0).to(tl.float32)
                dot += g * y
        if NEED_GW:
            tl.store(grad_w_ptr + n * K + j, tl.sum(dot, axis=0))


@triton.jit
def _zero_empty_experts_kernel(dw_ptr, counts_ptr, numel_per_expert, BLOCK: tl.constexpr):
    ex = tl.program_id(0)
    if tl.load(counts_ptr + ex) > 0:  # a non-empty expert's programs exit at once
        return
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dw_ptr + ex.to(tl.int64) * numel_per_expert + idx,
             tl.zeros([BLOCK], dtype=dw_ptr.dtype.element_ty), mask=idx < numel_per_expert)


@triton.jit
def _zero_gap_rows_kernel(buf_ptr, start_ptr, end_ptr, K, stride, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.program_id(0)  # the gap after expert i: [end[i], start[i+1]), shorter than A
    gap0 = tl.load(end_ptr + i)
    gap1 = tl.load(start_ptr + i + 1)
    rows = gap0 + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < gap1) & (cols[None, :] < K)
    tl.store(buf_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :],
             tl.zeros([BLOCK_M, BLOCK_K], dtype=buf_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------- wrappers
def zero_gap_rows_(buf_MK: torch.Tensor, layout) -> torch.Tensor:
    """Write zeros into the alignment gaps ``[end[i], start[i+1])`` of ``buf_MK``, in place.

    At most ``(e-1)·(A-1)`` rows are written (padding rows, which no consumer reads as data),
    so that a grouped weight-gradient GEMM over the unaligned ends ``[end[i-1], end[i])``
    adds exact zeros for the gap rows instead of whatever they held (NaN included).
    """
    e = layout.num_experts
    if e < 2 or layout.alignment == 1:
        return buf_MK
    k = buf_MK.shape[1]
    bm, bk = 32, 256
    grid = (e - 1, triton.cdiv(layout.alignment - 1, bm), triton.cdiv(k, bk))
    _zero_gap_rows_kernel[grid](buf_MK, layout.start, layout.end, k, buf_MK.stride(0), BLOCK_M=bm, BLOCK_K=bk)
    return buf_MK
def zero_empty_experts_(dw_eKN: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
    """Write exact zeros into ``dw[i]`` for every expert with ``counts[i] == 0``, in place (case-01).

    Only the empty experts' slices are touched (the programs of a non-empty expert exit at
    once), unlike a ``torch.where`` over the whole ``[e, K, N]`` gradient.
    """
    e = dw_eKN.shape[0]
    assert dw_eKN.is_contiguous()
    n = dw_eKN[0].numel()
    _zero_empty_experts_kernel[(e, triton.cdiv(n, 8192))](dw_eKN, counts_e, n, BLOCK=8192)
    return dw_eKN
_SWIGLU_BLOCK_M = 64
_SWIGLU_BLOCK_N = 128


def swiglu_fwd(h13_MI2: torch.Tensor, layout) -> torch.Tensor:
    """``[M, 2I]`` -> ``[M, I]`` = ``silu(gate) * up`` on live rows (padding rows unwritten)."""
    m, i2 = h13_MI2.shape
    i = i2 // 2
    h13_MI2 = h13_MI2.contiguous()
    out = h13_MI2.new_empty(m, i)
    tile_expert, tile_row, n_tiles = layout.tiles(_SWIGLU_BLOCK_M)
    grid = (n_tiles, triton.cdiv(i, _SWIGLU_BLOCK_N))
    _swiglu_kernel[grid](h13_MI2, h13_MI2, h13_MI2, out, tile_expert, tile_row, layout.end, i, h13_MI2.stride(0),
                         0, out.stride(0), BACKWARD=False, HAS_W=False, BLOCK_M=_SWIGLU_BLOCK_M,
                         BLOCK_N=_SWIGLU_BLOCK_N)
    return out


def swiglu_bwd(h13_MI2: torch.Tensor, dout_MI: torch.Tensor, layout, row_w_M: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Gradient ``[M, 2I]`` (d gate || d up) of :func:`swiglu_fwd` on live rows.

    With ``row_w_M`` (``[M]``, the folded routing weights) it is the gradient of
    ``swiglu_fwd(h13) · row_w`` given ``dout_MI`` = d(that product): ``dout`` is scaled by the
    row's weight (rounded to ``h13``'s dtype, as the forward multiplied it) in fp32 registers,
    so no scaled ``[M, I]`` copy of ``dout`` is made.
    """
    m, i2 = h13_MI2.shape
    i = i2 // 2
    h13_MI2, dout_MI = h13_MI2.contiguous(), dout_MI.contiguous()
    dh13 = h13_MI2.new_empty(m, i2)
    tile_expert, tile_row, n_tiles = layout.tiles(_SWIGLU_BLOCK_M)
    grid = (n_tiles, triton.cdiv(i, _SWIGLU_BLOCK_N))
    has_w = row_w_M is not None
    w = row_w_M.to(h13_MI2.dtype).contiguous() if has_w else dout_MI
    _swiglu_kernel[grid](h13_MI2, dout_MI, w, dh13, tile_expert, tile_row, layout.end, i, h13_MI2.stride(0),
                         dout_MI.stride(0), dh13.stride(0), BACKWARD=True, HAS_W=has_w,
                         BLOCK_M=_SWIGLU_BLOCK_M, BLOCK_N=_SWIGLU_BLOCK_N)
    return dh13


def gather_sum(rows_MH: torch.Tensor, dest_Nk: torch.Tensor, weight_Nk: torch.Tensor | None) -> torch.Tensor:
    """See :func:`dropless.permute.gather_sum` (same contract; one launch, fp32 in registers)."""
    n, k = dest_Nk.shape
    h = rows_MH.shape[1]
    rows_MH = rows_MH.contiguous()
    dest = dest_Nk.contiguous()
    out = rows_MH.new_empty(n, h)
    if n == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(h))
    w = weight_Nk.contiguous() if weight_Nk is not None else dest
    _gather_sum_kernel[(n, triton.cdiv(h, block_h))](rows_MH, dest, w, out, h, rows_MH.stride(0), out.stride(0),
                                                     K=k, HAS_W=weight_Nk is not None, BLOCK_H=block_h)
    return out


def combine_bwd(grad_NH: torch.Tensor, y_MH: torch.Tensor | None, dest_Nk: torch.Tensor,
                weight_Nk: torch.Tensor, num_rows_M: int, need_grad_w: bool):
    """Backward of the weighted combine: ``(grad_y [M, H] (padding unwritten), grad_w [N, k] fp32 or None)``."""
    n, k = dest_Nk.shape
    h = grad_NH.shape[1]
    grad_NH = grad_NH.contiguous()
    grad_y = grad_NH.new_empty(num_rows_M, h)
    grad_w = torch.empty(n, k, dtype=torch.float32, device=grad_NH.device) if need_grad_w else None
    if n == 0:
        return grad_y, grad_w
    y = y_MH.contiguous() if need_grad_w else grad_y
    _combine_bwd_kernel[(n,)](grad_NH, y, dest_Nk.contiguous(), weight_Nk.contiguous(), grad_y,
                              grad_w if need_grad_w else grad_y, h, grad_NH.stride(0), y.stride(0),
                              grad_y.stride(0), K=k, NEED_GW=need_grad_w, BLOCK_H=1024,
                              NUM_HB=triton.cdiv(h, 1024))
    return grad_y, grad_w
