"""``deepep``: DeepEP's NVLink/RDMA dispatch and combine kernels, landed in our live-row layout.

Two paths over the ``deep_ep`` package (github.com/deepseek-ai/DeepEP):

* **V1 ``Buffer``, normal (high-throughput) mode** — ``get_dispatch_layout`` then
  ``dispatch(..., expert_alignment=A)``. Its received rows are ONE row per (token, destination
  rank), grouped by source rank, with ``recv_topk_idx [N, k]`` holding *local* expert ids
  (``-1``: that choice lives on another rank). :func:`expand_received` (ours, pure torch)
  expands them into expert-sorted, aligned rows + :class:`ExpertLayout`; after the experts,
  :func:`reduce_to_received` forms each received row's weighted sum over its local choices
  (fp32, fixed ``j`` order), which DeepEP's ``combine`` — a plain sum, no weights — adds up
  over the ranks.
* **V2 ``ElasticBuffer``, expanded dispatch** (``do_expand=True, expert_alignment=A``): the
  received buffer is already one slot per (token, local expert), expert-sorted and aligned;
  the handle's ``psum_num_recv_tokens_per_expert`` is our ``end[]`` (DeepEP documents it as
  "aligned cumulative count of experts before i plus the actual count of expert i").
  :func:`layout_from_v2_psum` turns it into an :class:`ExpertLayout`.

The expansion and the conversion are tested on CPU. The adapter class itself needs
``deep_ep``, CUDA (Hopper / SM90), and NVSHMEM (V1) or NCCL >= 2.30.4 (V2), and has no
one-GPU path: it cannot run in this repository's CPU tests.

Host synchronisation: as DeepEP documents — V1 normal-mode ``dispatch`` waits on the CPU for
the received counts (its ``num_recv_tokens_per_expert_list``), V2 does the same unless given a
cached handle. Our code adds none: bytes are counted from the host-known shapes of the
received buffers.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dropless.config import ConfigError
from dropless.dispatch.base import Dispatched, Dispatcher, Pending
from dropless.dispatch.local import scatter_row_weights
from dropless.layout import ExpertLayout, align_up
from dropless.permute import combine_rows, permute_rows, sort_by_expert

INSTALL_HINT = (
    "the 'deepep' dispatcher needs the deep_ep package (DeepEP, github.com/deepseek-ai/DeepEP), which is "
    "built from source: `git clone https://github.com/deepseek-ai/DeepEP && cd DeepEP && "
    "python setup.py install` (or `pip install .`). It needs CUDA Hopper (SM90) GPUs with NVLink (RDMA "
    "across nodes), NCCL >= 2.30.4 (`pip install \"nvidia-nccl-cu13>=2.30.4\" --no-deps`) and, for the "
    "V1 Buffer path, NVSHMEM (set NVSHMEM_DIR when building; see DeepEP's docs/nvshmem.md). On CPU or "
    "without it use dispatcher=a2a, which moves the same rows with torch.distributed")


def require_deep_ep():
    """Import ``deep_ep`` or raise :class:`ConfigError` saying how to install it."""
    try:
        import deep_ep  # noqa: F401
    except Exception as err:  # ImportError, or its import-time CUDA/NCCL checks failing
        raise ConfigError(f"dispatcher=deepep: cannot import deep_ep ({type(err).__name__}: {err}); "
                          + INSTALL_HINT) from err
    return deep_ep


# ----------------------------------------------------------------------------- pure torch parts
def expand_received(recv_x_NH: torch.Tensor, recv_topk_idx_Nk: torch.Tensor, num_local_experts: int,
                    alignment: int = 1, capacity: int | None = None
                    ) -> tuple[torch.Tensor, ExpertLayout, torch.Tensor]:
    """Expand DeepEP V1's received rows into expert-sorted, aligned rows (no host sync).

    Args:
        recv_x_NH: ``[N, H]`` received rows, one per (source token, this rank), grouped by source rank.
        recv_topk_idx_Nk: int ``[N, k]`` local expert id of each choice, ``-1`` where the
            choice's expert lives on another rank.
        num_local_experts: ``e``.
        alignment: ``A``.
        capacity: static ``M``; default the exact bound for ``N·min(k, e)`` rows, or pass
            ``sum(num_recv_tokens_per_expert_list)`` (DeepEP's aligned per-expert counts, host list).
    Returns:
        rows_MH: ``[M, H]`` (row ``dest[n, j]`` is ``recv_x[n]``; padding rows unspecified),
        layout: the :class:`ExpertLayout`,
        dest_Nk: int64 ``[N, k]`` landed row of each choice (``-1``: not local).
    Within an expert, rows keep the received order (source rank, then DeepEP's token order).
    Differentiable in ``recv_x_NH`` (backward: sum of the row gradients over the local choices).
    """
    n, k = recv_topk_idx_Nk.shape
    if recv_x_NH.shape[0] != n:
        raise ValueError(f"expand_received: recv_x has {recv_x_NH.shape[0]} rows but recv_topk_idx {n}; pass "
                         "the recv_x and recv_topk_idx returned by the same DeepEP dispatch call")
    e = int(num_local_experts)
    layout, dest_Nk, src_M = sort_by_expert(recv_topk_idx_Nk, e, alignment, capacity, num_rows=n * min(k, e))
    return permute_rows(recv_x_NH, src_M, dest_Nk), layout, dest_Nk


def reduce_to_received(y_MH: torch.Tensor, dest_Nk: torch.Tensor, recv_topk_weight_Nk: torch.Tensor | None
                       ) -> torch.Tensor:
    """The reverse of :func:`expand_received`: ``out[n] = Σ_j w[n, j]·y[dest[n, j]]`` over local choices.

    fp32 accumulate in the fixed order ``j = 0 … k-1``; ``[N, H]`` in ``y``'s dtype, ready for
    DeepEP V1 ``combine`` (which adds the rows of each token over the ranks, without weights).
    ``recv_topk_weight_Nk`` None: plain sum (weights folded in before FC2).
    """
    return combine_rows(y_MH, dest_Nk, recv_topk_weight_Nk)


def layout_from_v2_psum(psum_e: torch.Tensor, alignment: int, capacity: int) -> ExpertLayout:
    """DeepEP V2 expanded-dispatch end points -> :class:`ExpertLayout` (device, no host sync).

    Args:
        psum_e: int ``[e]`` ``handle.psum_num_recv_tokens_per_expert`` of an expanded dispatch
            with ``expert_alignment = A``: ``psum[i] = align_up(psum[i-1], A) + count[i]``, i.e. our ``end[i]``.
        alignment: the ``A`` given to the dispatch.
        capacity: ``M``, rows of the expanded receive buffer (``recv_x.shape[0]``).
    Returns:
        the layout with ``end = psum``, ``start[0] = 0``, ``start[i] = align_up(end[i-1], A)``,
        ``counts = end - start``.
    """
    if psum_e.dim() != 1 or psum_e.dtype.is_floating_point:
        raise ValueError(f"layout_from_v2_psum: need an integer [e] tensor, got {psum_e.dtype} {tuple(psum_e.shape)}; "
                         "pass the expanded handle's psum_num_recv_tokens_per_expert")
    end = psum_e.to(torch.int32)
    start = torch.zeros_like(end)
    if end.numel() > 1:
        start[1:] = align_up(end[:-1], int(alignment))
    return ExpertLayout(counts=end - start, start=start, end=end, capacity=int(capacity), alignment=int(alignment))


def v2_slots_to_dest(recv_slot_idx_Nk: torch.Tensor) -> torch.Tensor:
    """DeepEP V2 expanded slots of each received token's choices (``-1``: not local) as our int64 ``dest_Nk``.

    The expanded handle's ``recv_src_metadata[:num_recv_tokens, 2:]`` holds, per received token,
    the slot of each of its ``k`` choices in the expanded buffer — the same thing as our
    ``dest_Nk``, so :func:`reduce_to_received` applies to V2 buffers too.
    """
    d = recv_slot_idx_Nk.to(torch.int64)
    return torch.where(d >= 0, d, torch.full_like(d, -1))


# ----------------------------------------------------------------------------- the adapter
@dataclass
class DeepEPHandle:
    """State the deepep combine needs.

    Attributes:
        version: 1 (``Buffer``) or 2 (``ElasticBuffer``).
        handle: DeepEP's own dispatch handle (reused by its combine).
        dest_Nk: V1: int64 ``[N, k]`` landed row of each received choice (-1: not local); V2: None.
        weight: fp32 routing weights — V1: ``recv_topk_weight [N, k]``; V2: per-slot ``[M]``;
            None when folded into the rows.
    """

    version: int
    handle: Any
    dest_Nk: torch.Tensor | None
    weight: torch.Tensor | None


class _V1Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weight, topk_idx, disp, alignment):
        buf = disp._buffer_v1(x)
        n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, disp.num_experts)
        recv_x, recv_idx, recv_w, counts_list, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert, topk_idx=topk_idx, topk_weights=topk_weight,
            expert_alignment=alignment)
        ctx.disp, ctx.handle = disp, handle
        disp._last = (handle, counts_list)
        disp._count(recv_x)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx

    @staticmethod
    def backward(ctx, g_x, g_w, _):
        buf = ctx.disp._v1
        gx, gw, _ev = buf.combine(g_x.contiguous(), ctx.handle, topk_weights=g_w)
        ctx.disp._count(g_x)
        return gx, gw, None, None, None


def _bias(addend_TH: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """The addend as DeepEP's combine ``bias``: ``[T, H]`` in the rows' dtype, contiguous."""
    return None if addend_TH is None else addend_TH.to(like.dtype).contiguous()


def _combine_with_bias(combine, x: torch.Tensor, bias: torch.Tensor | None, **kw) -> torch.Tensor:
    """DeepEP's ``combine(x, ..., bias=bias)``: the bias added to the fp32 sum before its one rounding.

    A DeepEP without the ``bias`` argument (older releases) gets the plain combine and the bias
    added after it, in fp32 and rounded again (two roundings), with a warning saying so.
    """
    if bias is None:
        return combine(x, **kw)[0]
    try:
        takes_bias = "bias" in inspect.signature(combine).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume a current DeepEP
        takes_bias = True
    if takes_bias:
        return combine(x, bias=bias, **kw)[0]
    warnings.warn("dispatcher=deepep: this deep_ep's combine has no 'bias' argument, so the shared experts' "
                  "output is added after it (the bf16 output is rounded twice); update DeepEP for one rounding",
                  stacklevel=2)
    out = combine(x, **kw)[0]
    return (out.float() + bias.float()).to(out.dtype)


def _bias_grad(ctx, g: torch.Tensor) -> torch.Tensor | None:
    """The gradient of the combine's ``bias`` input: the output's, in the addend's dtype."""
    return g.to(ctx.addend_dtype) if ctx.addend_dtype is not None and ctx.needs_input_grad[3] else None


class _V1Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial_NH, disp, handle, addend_TH):
        ctx.disp, ctx.handle = disp, handle
        ctx.addend_dtype = None if addend_TH is None else addend_TH.dtype
        out = _combine_with_bias(disp._v1.combine, partial_NH.contiguous(), _bias(addend_TH, partial_NH),
                                 handle=handle)
        disp._count(partial_NH)
        return out

    @staticmethod
    def backward(ctx, g):
        gx, *_ = ctx.disp._v1.dispatch(g.contiguous(), handle=ctx.handle)
        ctx.disp._count(gx)
        return gx, None, None, _bias_grad(ctx, g)


class _V2Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weight, topk_idx, disp, alignment):
        buf = disp._buffer_v2(x, topk_idx.shape[1])
        recv_x, _idx, recv_w, handle, _ev = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weight, num_experts=disp.num_experts,
            num_max_tokens_per_rank=disp.num_max_tokens_per_rank, expert_alignment=alignment, do_expand=True)
        ctx.disp, ctx.handle = disp, handle
        disp._last = (handle, None)
        disp._count(recv_x)
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, g_x, g_w):
        gx, gw, _ev = ctx.disp._v2.combine(g_x.contiguous(), handle=ctx.handle, topk_weights=g_w)
        ctx.disp._count(g_x)
        return gx, gw, None, None, None


class _V2Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MH, disp, handle, addend_TH):
        ctx.disp, ctx.handle = disp, handle
        ctx.addend_dtype = None if addend_TH is None else addend_TH.dtype
        out = _combine_with_bias(disp._v2.combine, y_MH.contiguous(), _bias(addend_TH, y_MH), handle=handle)
        disp._count(y_MH)
        return out

    @staticmethod
    def backward(ctx, g):
        gx, *_ = ctx.disp._v2.dispatch(g.contiguous(), handle=ctx.handle)
        ctx.disp._count(gx)
        return gx, None, None, _bias_grad(ctx, g)


class DeepEPDispatcher(Dispatcher):
    """DeepEP-backed dispatch (see the module docstring). Needs ``deep_ep`` and CUDA GPUs.

    Args:
        num_experts: ``E``.
        group: the EP process group (NCCL); None: the default (world) group.
        version: 1 (V1 ``Buffer`` normal mode) or 2 (V2 ``ElasticBuffer`` expanded dispatch).
        num_max_tokens_per_rank: V2 only: the most tokens any rank passes (sizes its buffer).
    Raises:
        ConfigError: ``deep_ep`` cannot be imported (the message says how to install it), or a
            bad ``version``.
    Bytes: received rows × row bytes per transfer, from host-known shapes (DeepEP's own CPU
    sync gives them); the self-rank share is included (DeepEP reports "logical" bandwidth the
    same way).
    """

    name = "deepep"
    options = ("version", "num_max_tokens_per_rank")

    @classmethod
    def check_available(cls) -> None:
        """:func:`require_deep_ep` (the ConfigError says how to install DeepEP)."""
        require_deep_ep()

    def __init__(self, num_experts: int, group: Any = None, *, version: int = 1,
                 num_max_tokens_per_rank: int | None = None):
        self._deep_ep = require_deep_ep()
        if version not in (1, 2):
            raise ConfigError(f"dispatcher.version={version}: DeepEP paths are 1 (Buffer) or 2 (ElasticBuffer)")
        if group is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ConfigError("dispatcher=deepep: torch.distributed is not initialised; launch with torchrun "
                                  "(DeepEP has no single-process path)")
            group = dist.group.WORLD
        super().__init__(num_experts, group)
        self.version = version
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self._v1 = self._v2 = None
        self._last = None

    def _count(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        self.comm.add(nbytes, nbytes)

    def _buffer_v1(self, x):
        if self._v1 is None:
            Buffer = self._deep_ep.Buffer
            hidden_bytes = x.shape[1] * max(x.element_size(), 2)
            n = self.ep_size
            nvl = rdma = 0
            for cfg in (Buffer.get_dispatch_config(n), Buffer.get_combine_config(n)):
                nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, n))
                rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, n))
            self._v1 = Buffer(self.group, nvl, rdma)
        return self._v1

    def _buffer_v2(self, x, num_topk):
        if self._v2 is None:
            if self.num_max_tokens_per_rank is None:
                raise ConfigError("dispatcher=deepep version=2: set num_max_tokens_per_rank (the most tokens "
                                  "any rank passes to one layer call)")
            self._v2 = self._deep_ep.ElasticBuffer(self.group, num_max_tokens_per_rank=self.num_max_tokens_per_rank,
                                                   hidden=x.shape[1], num_topk=num_topk)
        return self._v2

    def dispatch_async(self, x_TH, topk_idx_Tk, topk_weight_Tk, *, alignment=1, capacity=None,
                       fold_weights=False) -> Pending:  # DeepEP's calls return when the rows have landed
        return Pending(value=self._dispatch(x_TH, topk_idx_Tk, topk_weight_Tk, alignment, capacity, fold_weights))

    def _dispatch(self, x_TH, topk_idx_Tk, topk_weight_Tk, alignment, capacity, fold_weights) -> Dispatched:
        idx = topk_idx_Tk.to(self._deep_ep.topk_idx_t) if hasattr(self._deep_ep, "topk_idx_t") else topk_idx_Tk
        w = topk_weight_Tk.float()
        if self.version == 1:
            recv_x, recv_w, recv_idx = _V1Dispatch.apply(x_TH, w, idx, self, alignment)
            counts_list = self._last[1]
            cap = capacity if capacity is not None else max(int(sum(counts_list)), 0)
            rows_MH, layout, dest_Nk = expand_received(recv_x, recv_idx, self.num_local_experts, alignment, cap)
            if fold_weights:
                row_w = scatter_row_weights(recv_w, dest_Nk, layout.capacity)
                return Dispatched(rows_MH, layout, row_w, DeepEPHandle(1, self._last[0], dest_Nk, None))
            return Dispatched(rows_MH, layout, None, DeepEPHandle(1, self._last[0], dest_Nk, recv_w))
        recv_x, recv_w = _V2Dispatch.apply(x_TH, w, idx, self, alignment)
        handle = self._last[0]
        layout = layout_from_v2_psum(handle.psum_num_recv_tokens_per_expert, alignment, recv_x.shape[0])
        if fold_weights:
            return Dispatched(recv_x, layout, recv_w, DeepEPHandle(2, handle, None, None))
        return Dispatched(recv_x, layout, None, DeepEPHandle(2, handle, None, recv_w))

    def combine_async(self, y_MH, handle: DeepEPHandle, addend_TH=None) -> Pending:
        return Pending(value=self._combine(y_MH, handle, addend_TH))

    def _combine(self, y_MH, handle: DeepEPHandle, addend_TH) -> torch.Tensor:
        # the addend (shared experts' output) is DeepEP's combine ``bias``: its kernel adds it to
        # the fp32 sum over the ranks before the one rounding of the output
        if handle.version == 1:
            partial = reduce_to_received(y_MH, handle.dest_Nk, handle.weight)
            return _V1Combine.apply(partial, self, handle.handle, addend_TH)
        y = y_MH
        if handle.weight is not None:  # DeepEP's combine adds slots without weights
            y = (y_MH.float() * handle.weight.float().unsqueeze(1)).to(y_MH.dtype)
        return _V2Combine.apply(y, self, handle.handle, addend_TH)
