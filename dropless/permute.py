"""Permute tokens into expert-sorted, aligned rows and combine them back.

Where each row lands, :func:`sort_by_expert`, is the op of :mod:`dropless.ops.expert_sort`
(re-exported here). The permute and the combine are custom autograd Functions that save only
integer indices (MaxText's custom sort VJP; docs/design.md#memory): the backward of a gather is
the inverse gather, not a stored copy of the rows.

* :func:`permute_rows` lands rows straight from ``x_NH`` by index into the
  buffer (:func:`dropless.ops.rows.land_rows`: each token read once and scattered to
  its ``k`` rows by the Triton kernel, a gather by ``src_M`` elsewhere; no
  ``repeat_interleave(k)`` copy of x).
* :func:`combine_rows` is the weighted sum over ``k`` accumulated in fp32 in
  the fixed order ``j = 0 … k-1``, reading live rows only, plus an optional addend (the
  shared experts' output) in the same accumulator, rounded once.

Both only ever read the live rows named by ``dest_Nk``; padding rows of the
landed buffers and of their gradients are never read (docs/design.md#the-live-row-contract, rule 2).
When the combined rows come from the FP8 FC2 (:mod:`dropless.ops.fp8_grad_rows`), the
combine's backward also writes its gradient rows' e4m3 codes and scales for FC2's data
gradient (:func:`~dropless.ops.fp8_fused_rows.combine_bwd_quant`).
"""

from __future__ import annotations

import torch

from dropless.ops import fp8_grad_rows
from dropless.ops.backward import first_order_only
from dropless.ops.expert_sort import sort_by_expert  # noqa: F401 (re-exported)
from dropless.ops.fp8_fused_rows import combine_bwd_quant
from dropless.ops.rows import RowSource, combine_bwd, gather_rows, gather_sum, land_rows  # noqa: F401 (re-exported)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, src_M, dest_Nk):
        ctx.save_for_backward(dest_Nk)
        return land_rows(x_NH, src_M, dest_Nk)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_MH):
        (dest_Nk,) = ctx.saved_tensors
        return gather_sum(grad_MH, dest_Nk, None), None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MH, dest_Nk, weight_Nk, addend_AH, addend_row0):
        if weight_Nk is None:
            ctx.save_for_backward(dest_Nk)
        else:
            ctx.save_for_backward(dest_Nk, weight_Nk, y_MH)
        ctx.num_rows_M = y_MH.shape[0]
        ctx.codes = fp8_grad_rows.asked(y_MH)  # FP8 FC2 made y: quantise its gradient rows here
        ctx.addend = None if addend_AH is None else (addend_row0, addend_AH.shape[0], addend_AH.dtype)
        return gather_sum(y_MH, dest_Nk, weight_Nk, addend_AH, addend_row0)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_NH):
        saved = ctx.saved_tensors
        dest_Nk = saved[0]
        weight_Nk = saved[1] if len(saved) > 1 else None
        need_gw = weight_Nk is not None and ctx.needs_input_grad[2]
        y_MH = saved[2] if need_gw else None
        req = ctx.codes
        if req is not None and ctx.needs_input_grad[0]:
            grad_y, grad_w, q, s = combine_bwd_quant(grad_NH.contiguous(), y_MH, dest_Nk, weight_Nk, ctx.num_rows_M,
                                                     need_gw, req.group, req.ue8m0)
            req.put(grad_y, q, s)
        else:
            grad_y, grad_w = combine_bwd(grad_NH.contiguous(), y_MH, dest_Nk, weight_Nk, ctx.num_rows_M, need_gw)
        grad_add = None
        if ctx.addend is not None and ctx.needs_input_grad[3]:  # the addend's gradient is the output's
            row0, rows, dtype = ctx.addend
            grad_add = grad_NH[row0:row0 + rows].to(dtype)
        return grad_y, None, (grad_w.to(weight_Nk.dtype) if grad_w is not None else None), grad_add, None


def permute_rows(x_NH: torch.Tensor, src_M: torch.Tensor, dest_Nk: torch.Tensor) -> torch.Tensor:
    """Gather the landed buffer ``rows_MH[m] = x_NH[src_M[m]]`` (direct gather, no k-fold copy).

    Args:
        x_NH: ``[N, H]`` source rows (tokens, or rows received from other ranks).
        src_M: int64 ``[M]`` source row of each landed row, ``-1`` on padding.
        dest_Nk: int64 ``[N, k]`` landed row of each choice (``-1`` = not here); the
            only tensor saved for backward.
    Returns:
        ``[M, H]`` rows; padding rows hold unspecified values.
    Backward: ``grad_x[n] = Σ_j grad_rows[dest[n, j]]`` (fp32, fixed order), live rows only.
    """
    return _PermuteRows.apply(x_NH, src_M, dest_Nk)


def combine_rows(y_MH: torch.Tensor, dest_Nk: torch.Tensor, weight_Nk: torch.Tensor | None = None,
                 addend_AH: torch.Tensor | None = None, addend_row0: int = 0) -> torch.Tensor:
    """``out[n] = Σ_j weight[n, j] · y[dest[n, j]] (+ addend[n - row0])`` (fp32 accumulate, fixed ``j`` order,
    rounded once).

    Args:
        y_MH: ``[M, H]`` expert outputs; only live rows named by ``dest_Nk`` are read.
        dest_Nk: int64 ``[N, k]`` landed row of each choice, ``-1`` = contributes nothing.
        weight_Nk: ``[N, k]`` routing weights, or None for a plain sum (weights folded
            into the rows before FC2). With weights, ``y_MH`` is saved for their gradient;
            without, only the indices are.
        addend_AH: ``[A, H]`` (any float dtype), e.g. the shared experts' output, added to
            output rows ``addend_row0 … addend_row0 + A - 1`` in the same fp32 accumulator
            before the one rounding (:func:`dropless.ops.rows.gather_sum`); or None. Its
            gradient is the output's gradient on those rows.
        addend_row0: first output row the addend covers.
    Returns:
        ``[N, H]`` in ``y_MH``'s dtype.
    """
    return _CombineRows.apply(y_MH, dest_Nk, weight_Nk, addend_AH, addend_row0)
