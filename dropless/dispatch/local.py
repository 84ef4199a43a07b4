"""``local``: EP = 1, every expert on this rank; nothing moves, no host sync.

With FC1's row quantisation (``quant``, ``gemm=fp8`` / ``deep_gemm``) the gather that lands the
rows writes their e4m3 codes and scales in the same pass (:func:`~dropless.ops.fp8_rows.permute_fp8`):
``Dispatched.fp8`` with ``rows_kept``, and FC1 runs no quantisation pass of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dropless.dispatch.base import Dispatched, Dispatcher, Pending
from dropless.ops.fp8_rows import RowQuantiser, permute_fp8
from dropless.permute import RowSource, combine_rows, permute_rows, sort_by_expert


@dataclass
class LocalHandle:
    """State the local combine needs.

    Attributes:
        dest_Tk: int64 ``[T, k]`` landed row of each choice (-1: dropped by a capacity factor).
        weight_Tk: fp32 ``[T, k]`` combine weights; None when folded into the rows.
    """

    dest_Tk: torch.Tensor
    weight_Tk: torch.Tensor | None


def scatter_row_weights(weight_Nk: torch.Tensor, dest_Nk: torch.Tensor, capacity: int) -> torch.Tensor:
    """Routing weight of each landed row, for ``fold_routing_weights``.

    Args:
        weight_Nk: ``[N, k]`` routing weights (any float dtype; the result keeps it).
        dest_Nk: int64 ``[N, k]`` landed row of each choice (``-1``: not landed here).
        capacity: ``M``, rows of the landed buffer.
    Returns:
        ``[M]``: ``out[dest[n, j]] = weight[n, j]``, 0 on padding rows; differentiable in
        ``weight_Nk`` (its gradient is gathered back from the live rows). No host sync.
    """
    w = weight_Nk.reshape(-1)
    d = dest_Nk.reshape(-1)
    tgt = torch.where(d >= 0, d, torch.full_like(d, capacity))
    return w.new_zeros(capacity + 1).scatter(0, tgt, w)[:capacity]


class LocalDispatcher(Dispatcher):
    """EP = 1: every expert is on this rank; rows are gathered from ``x_TH`` by index, nothing moves.

    Args:
        num_experts: ``E`` (``n_routed_experts``), all local (``e = E``).
    ``M`` is the exact bound ``aligned_capacity(T·k, E, A)`` unless a capacity is given.
    No host sync, no collective.
    """

    name = "local"
    expert_parallel = False
    gathers_locally = True
    lands_fp8 = True
    collectives = ""

    def __init__(self, num_experts: int):
        super().__init__(num_experts)

    def dispatch_async(self, x_TH, topk_idx_Tk, topk_weight_Tk, *, alignment=1, capacity=None,
                       fold_weights=False, quant: RowQuantiser | None = None) -> Pending:
        return Pending(value=self._land(x_TH, topk_idx_Tk, topk_weight_Tk, alignment, capacity, fold_weights,
                                        gather=True, quant=quant))

    def dispatch_source(self, x_TH, topk_idx_Tk, topk_weight_Tk, *, alignment=1, capacity=None,
                        fold_weights=False, quant: RowQuantiser | None = None):
        return self._land(x_TH, topk_idx_Tk, topk_weight_Tk, alignment, capacity, fold_weights, gather=False)

    def _land(self, x_TH, topk_idx_Tk, topk_weight_Tk, alignment, capacity, fold_weights, gather, quant=None):
        """``quant`` (its form known, not while ``torch.compile`` traces: the fused kernel is no custom op):
        the rows and their codes land in one pass; else the rows only (FC1 quantises them)."""
        layout, dest_Tk, src_M = sort_by_expert(topk_idx_Tk, self.num_experts, alignment, capacity)
        fp8 = rows_MH = None
        if gather and quant is not None and quant.group is not None and not torch.compiler.is_compiling():
            rows_MH, fp8 = permute_fp8(x_TH, src_M, dest_Tk, quant)
        elif gather:
            rows_MH = permute_rows(x_TH, src_M, dest_Tk)
        row_w = scatter_row_weights(topk_weight_Tk, dest_Tk, layout.capacity) if fold_weights else None
        return Dispatched(rows_MH, layout, row_w, LocalHandle(dest_Tk, None if fold_weights else topk_weight_Tk),
                          RowSource(x_TH, src_M, dest_Tk), fp8=fp8)

    def combine_async(self, y_MH, handle: LocalHandle, addend_TH=None) -> Pending:
        return Pending(value=combine_rows(y_MH, handle.dest_Tk, handle.weight_Tk, addend_TH))
