"""Permute tokens into expert-sorted, aligned rows and combine them back.

Both are custom autograd Functions that save only integer indices (MaxText's
custom sort VJP; DESIGN.md "Memory"): the backward of a gather is the inverse
gather, not a stored copy of the rows.

* :func:`permute_rows` gathers rows straight from ``x_NH`` by index into the
  landed buffer (direct token gather: no ``repeat_interleave(k)`` copy of x).
* :func:`combine_rows` is the weighted sum over ``k`` accumulated in fp32 in
  the fixed order ``j = 0 … k-1``, reading live rows only.

Both only ever read the live rows named by ``dest_Nk``; padding rows of the
landed buffers and of their gradients are never read (DESIGN.md rule 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dropless.layout import ExpertLayout
from dropless.ops import use_triton
from dropless.ops.backward import first_order_only


def sort_by_expert(expert_idx_Nk: torch.Tensor, num_experts: int, alignment: int = 1,
                   capacity: int | None = None, num_rows: int | None = None
                   ) -> tuple[ExpertLayout, torch.Tensor, torch.Tensor]:
    """Where each (row, choice) lands in an expert-sorted, aligned buffer. No host sync.

    Args:
        expert_idx_Nk: int ``[N, k]`` expert of each choice, in ``[0, num_experts)``;
            a value ``< 0`` or ``>= num_experts`` means "not routed here" (dropped
            from this buffer, e.g. another rank's expert).
        num_experts: ``e``, experts in the buffer.
        alignment: ``A``.
        capacity: static ``M``; default the exact bound for ``N·k`` rows
            (:func:`dropless.layout.aligned_capacity`).
        num_rows: host bound on the rows routed here (defaults to ``N·k``).
    Returns:
        layout: the :class:`ExpertLayout`.
        dest_Nk: int64 ``[N, k]`` landed row of each choice; ``-1`` where not routed here.
        src_M: int64 ``[M]`` source row of each landed row; ``-1`` on padding rows.
    """
    n, k = expert_idx_Nk.shape
    dev = expert_idx_Nk.device
    flat = expert_idx_Nk.reshape(-1).to(torch.int64)
    here = (flat >= 0) & (flat < num_experts)
    # not-routed choices sort after every real expert (key = num_experts)
    key = torch.where(here, flat, torch.full_like(flat, num_experts))
    counts_all = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts_all.scatter_add_(0, key, torch.ones_like(key))
    counts = counts_all[:num_experts]
    if capacity is None:
        capacity_rows = n * k if num_rows is None else num_rows
        layout = ExpertLayout.from_counts(counts, alignment, num_rows=capacity_rows)
    else:
        layout = ExpertLayout.from_counts(counts, alignment, capacity=capacity)
    layout.check_capacity()  # never drop a row silently, whatever the bound (async on GPU, no sync)
    order = torch.argsort(key, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=dev)
    first_sorted = torch.cumsum(counts_all, 0) - counts_all  # first sorted position of each key
    key_c = key.clamp(max=max(num_experts - 1, 0))
    dest = layout.start.to(torch.int64)[key_c] + (pos - first_sorted[key])
    dest = torch.where(here, dest, torch.full_like(dest, -1))
    src = torch.full((layout.capacity + 1,), -1, dtype=torch.int64, device=dev)
    # not-routed choices write into the extra slot M, which is cut off below
    src.scatter_(0, torch.where(here & (dest < layout.capacity), dest, torch.full_like(dest, layout.capacity)),
                 torch.arange(n * k, device=dev) // k)
    return layout, dest.view(n, k), src[: layout.capacity]


@dataclass
class RowSource:
    """A landed buffer given by where its rows come from, not materialised.

    ``rows_MH[m] = x_NH[src_M[m]]`` (:func:`gather_rows`); its gradient goes back to ``x_NH``
    as ``Σ_j grad_rows[dest_Nk[n, j]]``. Dispatchers that land rows by a local gather
    (``local``, ``fsdp``) can return this, so that the experts save ``x_NH`` (which the
    router keeps anyway) and re-gather in backward instead of saving ``[M, H]``
    (``recompute_gather``; seed 003 §4: the buffer is ``k``× the layer input).

    Attributes:
        x_NH: ``[N, H]`` source rows. src_M: int64 ``[M]`` (``-1`` on padding).
        dest_Nk: int64 ``[N, k]`` landed row of each choice (``-1``: not landed).
    """

    x_NH: torch.Tensor
    src_M: torch.Tensor
    dest_Nk: torch.Tensor


def gather_rows(x_NH: torch.Tensor, src_M: torch.Tensor) -> torch.Tensor:
    """``rows_MH[m] = x_NH[src_M[m]]`` without autograd; padding rows (``src = -1``) unspecified."""
    if x_NH.shape[0] == 0:  # a rank that received no rows: every landed row is padding
        return x_NH.new_empty(src_M.shape[0], x_NH.shape[1])
    # padding rows read row 0: garbage by contract, never used
    return x_NH.index_select(0, src_M.clamp(min=0))


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, src_M, dest_Nk):
        ctx.save_for_backward(dest_Nk)
        return gather_rows(x_NH, src_M)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_MH):
        (dest_Nk,) = ctx.saved_tensors
        return gather_sum(grad_MH, dest_Nk, None), None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MH, dest_Nk, weight_Nk):
        if weight_Nk is None:
            ctx.save_for_backward(dest_Nk)
        else:
            ctx.save_for_backward(dest_Nk, weight_Nk, y_MH)
        ctx.num_rows_M = y_MH.shape[0]
        return gather_sum(y_MH, dest_Nk, weight_Nk)

    @staticmethod
    @first_order_only
    def backward(ctx, grad_NH):
        saved = ctx.saved_tensors
        dest_Nk = saved[0]
        weight_Nk = saved[1] if len(saved) > 1 else None
        grad_NH = grad_NH.contiguous()
        n, k = dest_Nk.shape
        if use_triton(grad_NH):
            from dropless.ops import triton_kernels

            w = weight_Nk if weight_Nk is not None else torch.ones(n, k, device=grad_NH.device)
            need_gw = weight_Nk is not None and ctx.needs_input_grad[2]
            grad_y, grad_w = triton_kernels.combine_bwd(grad_NH, saved[2] if need_gw else None, dest_Nk, w,
                                                        ctx.num_rows_M, need_gw)
            return grad_y, None, (grad_w.to(weight_Nk.dtype) if grad_w is not None else None)
        acc_dt = torch.promote_types(grad_NH.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        g32 = grad_NH.to(acc_dt)
        # padding rows of the gradient stay unwritten: nothing downstream reads them.
        # One scratch row at index M takes the writes of choices routed elsewhere (dest < 0).
        m = ctx.num_rows_M
        grad_ext = grad_NH.new_empty(m + 1, grad_NH.shape[1])
        for j in range(k):
            idx = dest_Nk[:, j]
            tgt = torch.where(idx >= 0, idx, torch.full_like(idx, m))
            src = grad_NH if weight_Nk is None else (g32 * weight_Nk[:, j : j + 1].to(acc_dt)).to(grad_NH.dtype)
            grad_ext.index_copy_(0, tgt, src)
        grad_y = grad_ext[:m]
        grad_w = None
        if weight_Nk is not None and ctx.needs_input_grad[2]:
            y_MH = saved[2]
            cols = []
            for j in range(k):
                idx = dest_Nk[:, j]
                yj = y_MH.index_select(0, idx.clamp(min=0)).to(acc_dt)
                dot = (g32 * yj).sum(-1)
                cols.append(torch.where(idx >= 0, dot, torch.zeros_like(dot)))
            grad_w = torch.stack(cols, 1).to(weight_Nk.dtype)
        return grad_y, None, grad_w


def gather_sum(rows_MH: torch.Tensor, dest_Nk: torch.Tensor, weight_Nk: torch.Tensor | None) -> torch.Tensor:
    """``out[n] = Σ_j w[n, j] · rows[dest[n, j]]`` over ``j = 0 … k-1`` in fp32 (fp64 for fp64 rows), fixed order.

    Choices with ``dest < 0`` contribute nothing (their rows are not even read as data:
    a masked select, since ``0 · NaN = NaN``). Returns ``rows_MH``'s dtype, ``[N, H]``.
    """
    if use_triton(rows_MH) and rows_MH.dtype != torch.float64:
        from dropless.ops import triton_kernels

        return triton_kernels.gather_sum(rows_MH, dest_Nk, weight_Nk)
    n, k = dest_Nk.shape
    acc_dt = torch.promote_types(rows_MH.dtype, torch.float32)  # fp32, or fp64 for fp64 rows
    acc = torch.zeros(n, rows_MH.shape[1], dtype=acc_dt, device=rows_MH.device)
    for j in range(k):
        idx = dest_Nk[:, j]
        live = (idx >= 0).unsqueeze(1)
        r = rows_MH.index_select(0, idx.clamp(min=0)).to(acc_dt)
        if weight_Nk is not None:
            r = r * weight_Nk[:, j : j + 1].to(acc_dt)
        acc += torch.where(live, r, torch.zeros((), device=r.device))
    return acc.to(rows_MH.dtype)


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


def combine_rows(y_MH: torch.Tensor, dest_Nk: torch.Tensor, weight_Nk: torch.Tensor | None = None) -> torch.Tensor:
    """``out[n] = Σ_j weight[n, j] · y[dest[n, j]]`` (fp32 accumulate, fixed ``j`` order).

    Args:
        y_MH: ``[M, H]`` expert outputs; only live rows named by ``dest_Nk`` are read.
        dest_Nk: int64 ``[N, k]`` landed row of each choice, ``-1`` = contributes nothing.
        weight_Nk: ``[N, k]`` routing weights, or None for a plain sum (weights folded
            into the rows before FC2). With weights, ``y_MH`` is saved for their gradient;
            without, only the indices are.
    Returns:
        ``[N, H]`` in ``y_MH``'s dtype.
    """
    return _CombineRows.apply(y_MH, dest_Nk, weight_Nk)
