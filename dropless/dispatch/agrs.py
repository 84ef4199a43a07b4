"""``agrs``: every token to every EP rank (all-gather), partial outputs back (reduce-scatter).

One layer call, on each of the ``EP`` ranks of the group (docs/design.md#dispatchers)::

    all_gather_into_tensor  x_TH, topk_idx_Tk, topk_weight_Tk  -> [EP·T, H], [EP·T, k], [EP·T, k]
    select the gathered choices whose expert is local (ids outside [offset, offset+e) are
      "not here"), sort them by local expert, aligned to A      -> rows_MH + ExpertLayout
    ... experts ...
    partial[n] = Σ_{j local} w[n, j]·y[dest[n, j]]  (fp32, j = 0 … k-1) for ALL EP·T tokens,
      + the shared experts' output on this rank's own T rows (same fp32 sum, one rounding)
    reduce_scatter_tensor (SUM)                                  -> y_TH

No host synchronisation and static shapes: ``M`` is the static bound
``aligned_capacity(EP·T·min(k, e), e, A)`` (a token meets each local expert at most once),
or the ``capacity`` given. Every EP rank must pass the same ``T`` (``all_gather_into_tensor``
needs equal chunks); otherwise the collective fails with a :class:`CollectiveError`.

Backward: the all-gather's VJP is a reduce-scatter (SUM) of the gathered gradients, so each
rank's ``dx_TH`` is the sum over EVERY rank's experts — not only the gradient through its
own experts — and likewise for the routing weights; the reduce-scatter's VJP is an all-gather.

Precision: each rank sums its local choices (and, on its own tokens, the shared experts'
output) in fp32 and rounds to ``y``'s dtype before the reduce-scatter, which then adds the
EP partials in that dtype (exact match to ``local`` within fp32 rounding for fp32; one
rounding at EP = 1 as ``local``, one extra rounding per further rank for bf16).

FP8 dispatch (``quant``, ``gemm=fp8`` / ``deep_gemm``; docs/design.md#fp8-dispatch): each rank
quantises its ``T`` tokens once (FC1's row quantisation) and all-gathers their e4m3 codes (uint8
``[T, H]``) and scales (fp32 ``[T, G]``) instead of ``x``; the local choices land as
:class:`~dropless.ops.fp8_rows.Fp8Rows`. Backward: the landed rows' gradient is summed per
gathered token (fp32, over ``k``) and reduce-scattered, as the all-gather's VJP does without
FP8 dispatch. The partial outputs' reduce-scatter stays in the compute dtype.

Bytes counted per call (``self.comm``, forward + backward), with ``b`` the activation bytes:
all-gather of ``x``: ``(EP-1)·T·H·b`` sent and received; of the routing: ``(EP-1)·T·k·(8 + 4)``;
reduce-scatter of the partial outputs: ``(EP-1)·T·H·b`` each way. Backward repeats the ``x`` and
output terms (reduce-scatter of ``dx``, all-gather of ``dy``) and the weights' ``(EP-1)·T·k·4``.
With FP8 dispatch the forward all-gather of ``x`` is ``(EP-1)·T·(H + 4·G)`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dropless.dispatch.base import Dispatched, Dispatcher, Pending
from dropless.dispatch.collectives import CollOp, start, wait
from dropless.dispatch.local import scatter_row_weights
from dropless.ops.fp8_rows import RowQuantiser, grad_port, land_fp8
from dropless.ops.rows import gather_sum
from dropless.permute import combine_rows, permute_rows, sort_by_expert


@dataclass
class AGRSHandle:
    """State the agrs combine needs.

    Attributes:
        dest_Nk: int64 ``[EP·T, k]`` landed row of each gathered choice (-1: not local).
        weight_Nk: fp32 ``[EP·T, k]`` gathered combine weights; None when folded.
    """

    dest_Nk: torch.Tensor
    weight_Nk: torch.Tensor | None


class AGRSDispatcher(Dispatcher):
    """All-gather / reduce-scatter dispatch over the EP group (see the module docstring).

    Args:
        num_experts: ``E``.
        group: the EP process group (e.g. ``mesh["ep"].get_group()``, or ``dist.group.WORLD``);
            None: EP = 1, nothing moves (single-rank runs and tests).
    """

    name = "agrs"
    lands_fp8 = True

    def dispatch_async(self, x_TH, topk_idx_Tk, topk_weight_Tk, *, alignment=1, capacity=None,
                       fold_weights=False, quant: RowQuantiser | None = None) -> Pending:
        t, k = topk_idx_Tk.shape
        e = self.num_local_experts
        x_op = CollOp("ag", self.group, self._what("token all-gather"), comm=self.comm)
        i_op = CollOp("ag", self.group, self._what("expert-id all-gather"), comm=self.comm)
        w_op = CollOp("ag", self.group, self._what("weight all-gather"), comm=self.comm)
        if quant is None:
            xg = start(x_TH, x_op)
        else:  # FP8 dispatch: each token quantised once, its codes and scales gathered
            codes_TH, scales_TG, rowwise = quant(x_TH)
            s_op = CollOp("ag", self.group, self._what("scale all-gather"), comm=self.comm)
            xg, sg = start(codes_TH, x_op), start(scales_TG, s_op)
        ig = start(topk_idx_Tk.to(torch.int64), i_op)
        wg = start(topk_weight_Tk, w_op)
        idx_Nk = wait(ig, i_op)
        # ids of other ranks' experts fall outside [0, e), and dropped choices (-1) stay < 0:
        # sort_by_expert leaves both out. Without a capacity, M is the static bound for
        # EP·T·min(k, e) rows (a token meets each local expert at most once).
        local_Nk = idx_Nk - self.expert_offset
        layout, dest_Nk, src_M = sort_by_expert(local_Nk, e, alignment, capacity,
                                                num_rows=self.ep_size * t * min(k, e))

        def reverse(grad_MH: torch.Tensor):
            """FP8 dispatch's backward: per gathered token the sum of its rows' gradients, reduce-scattered
            (issued here; the returned ``finish()`` waits for this rank's ``[T, H]``)."""
            op = CollOp("rs", self.group, self._what("token all-gather (backward)"), comm=self.comm)
            out = start(gather_sum(grad_MH, dest_Nk, None), op)
            return lambda: wait(out, op)

        def finish() -> Dispatched:
            x_NH = wait(xg, x_op)
            w_Nk = wait(wg, w_op)
            fp8 = None
            if quant is None:
                rows_MH = permute_rows(x_NH, src_M, dest_Nk)
            else:
                fp8 = land_fp8(x_NH, wait(sg, s_op), src_M, dest_Nk, rowwise)
                rows_MH = grad_port(x_TH, layout.capacity, quant.dtype, reverse)
            row_w = scatter_row_weights(w_Nk, dest_Nk, layout.capacity) if fold_weights else None
            return Dispatched(rows_MH, layout, row_w, AGRSHandle(dest_Nk, None if fold_weights else w_Nk),
                              fp8=fp8)

        return Pending(finish)

    def combine_async(self, y_MH, handle: AGRSHandle, addend_TH=None) -> Pending:
        # [EP·T, H], local choices only; the addend joins this rank's own T rows in the fp32 sum
        t = handle.dest_Nk.shape[0] // self.ep_size
        partial_NH = combine_rows(y_MH, handle.dest_Nk, handle.weight_Nk, addend_TH, self.ep_rank * t)
        op = CollOp("rs", self.group, self._what("output reduce-scatter"), comm=self.comm)
        out = start(partial_NH, op)
        return Pending(lambda: wait(out, op))
