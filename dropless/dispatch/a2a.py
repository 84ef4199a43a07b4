"""``a2a``: tokens go to the expert-parallel ranks that own their experts (all-to-all).

Expert ``g`` (global id) lives on EP rank ``g // e`` (``e = E / EP``), as local expert ``g % e``.

One layer call, on each rank (docs/design.md#the-pipeline, #dispatchers)::

    sort the rank's (token, choice) pairs by global expert      -> send buffer [T·k, H]
      (rows grouped by destination rank, within it by expert; direct gather from x_TH)
    all_to_all_single of the per-expert counts [EP, e]          (device, async)
    ONE host copy: rows to send to / receive from each rank      (split sizes for the next collective)
    all_to_all_single of the rows  (async, differentiable)      -> received [R, H], grouped by source rank
    sort the received rows by local expert, aligned to A         -> rows_MH + ExpertLayout
    ... experts ...
    gather each received row's output back into received order -> [R, H]
    all_to_all_single back (reversed splits)                    -> [n_send, H] in send order
    weighted sum over k at the source, fp32, j = 0 … k-1,
      + the shared experts' output, rounded once                 -> y_TH   (same formula as ``local``)

Host synchronisation: exactly one per :meth:`dispatch` — ``all_to_all_single`` takes its
split sizes as host integers, so after the (device) count exchange the 2·EP row totals
(sent to / received from each rank) are copied to the host once, in one ``.tolist()``
(in :meth:`A2ADispatcher.dispatch_async`). Combine and both backwards reuse them. With a
static ``capacity`` the landed buffer has a fixed ``M``; without, ``M`` is the exact bound
of the received rows (:func:`dropless.layout.aligned_capacity`).

Routing weights stay at the source and are applied in the source-side combine, unless
``fold_weights`` (then they travel with the rows, fp32, and the combine is a plain sum).
Row order inside each expert segment is (source rank, token, choice) — the order ``local``
gives the global batch laid out rank after rank.

Asynchrony: :meth:`A2ADispatcher.dispatch_async` issues the count exchange, builds the send
buffer while it is in flight, makes the host copy, issues the row all-to-all and computes the
landing indices while the rows travel; ``.wait()`` blocks on the rows and lands them.
:meth:`A2ADispatcher.combine_async` issues the return all-to-all; ``.wait()`` does the
weighted sum. Backward overlaps the same way (see :mod:`dropless.dispatch.collectives`).

FP8 dispatch (``quant``, ``gemm=fp8`` / ``deep_gemm``; docs/design.md#fp8-dispatch): the
rank's ``T`` tokens are quantised once (FC1's row quantisation,
:class:`~dropless.ops.fp8_rows.RowQuantiser`), and the send buffer holds each choice's e4m3
codes (uint8 ``[n_send, H]``) and scales (fp32 ``[n_send, G]``, ``G`` = 1 or ``H/128``), moved by
two all-to-alls with the same splits and landed by the same indices as
:class:`~dropless.ops.fp8_rows.Fp8Rows`. Backward: the landed rows' gradient (compute dtype)
takes the reverse path of the compute-dtype dispatch (landed -> received order, all-to-all
back, sum over ``k`` in fp32 at the source), the same values as without FP8 dispatch.

Bytes counted per call (``self.comm``): rows (and folded weights) that leave / enter the
rank in each all-to-all, forward and backward, plus the count matrix (``(EP-1)·e`` int32
each way). A row is ``H·itemsize`` bytes, an FP8-dispatched one ``H + 4·G`` bytes in the dispatch
(its gradient ``H·itemsize`` in backward); the rank's own rows are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dropless.dispatch.base import Dispatched, Dispatcher, Pending
from dropless.dispatch.collectives import CollOp, start, wait
from dropless.dispatch.local import scatter_row_weights
from dropless.ops.fp8_rows import RowQuantiser, grad_port, land_fp8
from dropless.ops.rows import gather_sum, land_rows
from dropless.permute import combine_rows, permute_rows, sort_by_expert


@dataclass
class A2AHandle:
    """State the a2a combine needs (integer indices and host split sizes only).

    Attributes:
        send_dest_Tk: int64 ``[T, k]`` row of each choice in the send buffer (-1: dropped).
        weight_Tk: fp32 ``[T, k]`` combine weights at the source; None when folded.
        recv_dest_R1: int64 ``[R, 1]`` landed row of each received row.
        send_splits, recv_splits: rows sent to / received from each EP rank (host ints).
    """

    send_dest_Tk: torch.Tensor
    weight_Tk: torch.Tensor | None
    recv_dest_R1: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]


class A2ADispatcher(Dispatcher):
    """All-to-all dispatch over the expert-parallel group (see the module docstring).

    Args:
        num_experts: ``E`` (``n_routed_experts``).
        group: the EP process group (e.g. ``mesh["ep"].get_group()``, or ``dist.group.WORLD``);
            None: EP = 1, nothing moves (single-rank runs and tests).
    Raises:
        ConfigError: ``E`` not divisible by the group size.
        CollectiveError: a collective failed or timed out (a peer died or stopped taking part).
    """

    name = "a2a"
    lands_fp8 = True

    # ------------------------------------------------------------------ dispatch
    def dispatch_async(self, x_TH, topk_idx_Tk, topk_weight_Tk, *, alignment=1, capacity=None,
                       fold_weights=False, quant: RowQuantiser | None = None) -> Pending:
        ep, e = self.ep_size, self.num_local_experts
        # 1. sort by global expert -> send order (grouped by destination rank, then expert)
        send_layout, send_dest_Tk, send_src = sort_by_expert(topk_idx_Tk, self.num_experts, 1)
        counts_E = send_layout.counts  # int32 [E]
        counts_op = CollOp("a2a", self.group, self._what("count all-to-all"), [e] * ep, [e] * ep, self.comm)
        recv_counts = start(counts_E, counts_op)
        # 2. while the counts travel: gather the send buffer straight from x_TH (FP8: from its codes
        #    and scales, quantised once per token)
        if quant is None:
            send_NH = permute_rows(x_TH, send_src, send_dest_Tk)
        else:
            codes_TH, scales_TG, rowwise = quant(x_TH)
            send_NH = land_rows(codes_TH, send_src, send_dest_Tk)
            send_NG = land_rows(scales_TG, send_src, send_dest_Tk)
        send_w = scatter_row_weights(topk_weight_Tk, send_dest_Tk, send_src.numel()) if fold_weights else None
        recv_counts_Ee = wait(recv_counts, counts_op).view(ep, e)
        # 3. THE host copy of this layer call: per-rank row totals for the split sizes
        totals = torch.cat([counts_E.view(ep, e).sum(1), recv_counts_Ee.sum(1)]).tolist()
        send_splits, recv_splits = [int(v) for v in totals[:ep]], [int(v) for v in totals[ep:]]
        n_send, n_recv = sum(send_splits), sum(recv_splits)
        # 4. issue the rows (and folded weights)
        rows_op = CollOp("a2a", self.group, self._what("row all-to-all"), recv_splits, send_splits, self.comm)
        recv_RH = start(send_NH[:n_send], rows_op)
        if quant is not None:
            scales_op = CollOp("a2a", self.group, self._what("scale all-to-all"), recv_splits, send_splits, self.comm)
            recv_RG = start(send_NG[:n_send], scales_op)
        w_op = recv_w = None
        if fold_weights:
            w_op = CollOp("a2a", self.group, self._what("weight all-to-all"), recv_splits, send_splits, self.comm)
            recv_w = start(send_w[:n_send].unsqueeze(1), w_op)
        # 5. while the rows travel: each received row's local expert, and where it lands
        local_ids = torch.arange(e, device=counts_E.device).repeat(ep)
        recv_expert_R = torch.repeat_interleave(local_ids, recv_counts_Ee.reshape(-1).to(torch.int64),
                                                output_size=n_recv)
        layout, recv_dest_R1, src_M = sort_by_expert(recv_expert_R.unsqueeze(1), e, alignment, capacity,
                                                     num_rows=n_recv)
        weight_Tk = None if fold_weights else topk_weight_Tk
        handle = A2AHandle(send_dest_Tk, weight_Tk, recv_dest_R1, send_splits, recv_splits)

        def reverse(grad_MH: torch.Tensor):
            """FP8 dispatch's backward: issue the landed rows' gradient (received order) back to the source
            ranks; the returned ``finish()`` waits and sums each token's ``k`` rows, ``[T, H]``."""
            op = CollOp("a2a", self.group, self._what("row all-to-all (backward)"), send_splits, recv_splits,
                        self.comm)
            back = start(gather_sum(grad_MH, recv_dest_R1, None), op)
            return lambda: gather_sum(wait(back, op), send_dest_Tk, None)

        def finish() -> Dispatched:
            rows_in = wait(recv_RH, rows_op)
            fp8 = None
            if quant is None:
                rows_MH = permute_rows(rows_in, src_M, recv_dest_R1)  # a rank that received 0 rows: all padding
            else:
                fp8 = land_fp8(rows_in, wait(recv_RG, scales_op), src_M, recv_dest_R1, rowwise)
                rows_MH = grad_port(x_TH, layout.capacity, quant.dtype, reverse)
            row_w = None
            if fold_weights:
                w_in = wait(recv_w, w_op).squeeze(1)
                row_w = scatter_row_weights(w_in.unsqueeze(1), recv_dest_R1, layout.capacity)
            return Dispatched(rows_MH, layout, row_w, handle, fp8=fp8)

        return Pending(finish)

    # ------------------------------------------------------------------- combine
    def combine_async(self, y_MH, handle: A2AHandle, addend_TH=None) -> Pending:
        back_RH = combine_rows(y_MH, handle.recv_dest_R1, None)  # received order, live rows only
        op = CollOp("a2a", self.group, self._what("combine all-to-all"), handle.send_splits, handle.recv_splits,
                    self.comm)
        sent = start(back_RH, op)

        def finish() -> torch.Tensor:
            back_NH = wait(sent, op)
            return combine_rows(back_NH, handle.send_dest_Tk, handle.weight_Tk, addend_TH)

        return Pending(finish)
