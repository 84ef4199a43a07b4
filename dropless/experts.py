"""Routed SwiGLU experts over a live-row layout (grouped GEMM gate||up, SwiGLU, down)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dropless.layout import ExpertLayout, poison_padding
from dropless.ops import get_backend, grouped_mm, use_triton


def init_expert_weights_(w13_eHI2: torch.Tensor, w2_eIH: torch.Tensor, seed: int, layer_id: int,
                         expert_offset: int, std: float) -> None:
    """Initialise local experts from their GLOBAL expert index, independent of the layout.

    Expert ``g`` (global id) draws from a generator seeded by ``(seed, layer_id, g)``, so the
    same seed gives the same global expert weights whatever EP is (runs compare across
    parallel layouts). Both weights ~ Normal(0, ``std``), drawn in fp32 on the CPU and
    copied in (the same values on any device or dtype). No-op on the meta device.
    """
    if w13_eHI2.is_meta:
        return
    e = w13_eHI2.shape[0]
    with torch.no_grad():
        for i in range(e):
            g = torch.Generator(device="cpu")
            g.manual_seed((int(seed) * 1_000_003 + int(layer_id) * 10_007 + expert_offset + i) & 0x7FFF_FFFF_FFFF)
            a = torch.empty(w13_eHI2.shape[1:], dtype=torch.float32).normal_(0.0, std, generator=g)
            b = torch.empty(w2_eIH.shape[1:], dtype=torch.float32).normal_(0.0, std, generator=g)
            w13_eHI2[i].copy_(a)
            w2_eIH[i].copy_(b)


def _swiglu_fwd(h13_MI2: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """``silu(gate) * up`` without autograd: the live-row Triton kernel on CUDA, torch ops elsewhere."""
    if use_triton(h13_MI2):
        from dropless.ops import triton_kernels

        return triton_kernels.swiglu_fwd(h13_MI2, layout)
    gate, up = h13_MI2.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_bwd(h13_MI2: torch.Tensor, dh_MI: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Gradient ``[M, 2I]`` (d gate || d up) of :func:`_swiglu_fwd`, computed in fp32 (fp64 for fp64)."""
    if use_triton(h13_MI2):
        from dropless.ops import triton_kernels

        return triton_kernels.swiglu_bwd(h13_MI2, dh_MI, layout)
    acc = torch.promote_types(h13_MI2.dtype, torch.float32)
    gate, up = h13_MI2.to(acc).chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    dh = dh_MI.to(acc)
    return torch.cat([dh * up * s * (1 + gate * (1 - s)), dh * gate * s], dim=-1).to(h13_MI2.dtype)


class _SwiGLU(torch.autograd.Function):
    """SwiGLU that saves only its input ``h13`` (not ``silu(gate)`` as autograd of the torch ops would)."""

    @staticmethod
    def forward(ctx, h13_MI2, layout):
        ctx.layout = layout
        ctx.save_for_backward(h13_MI2)
        return _swiglu_fwd(h13_MI2, layout)

    @staticmethod
    def backward(ctx, dout_MI):
        (h13_MI2,) = ctx.saved_tensors
        return _swiglu_bwd(h13_MI2, dout_MI.contiguous(), ctx.layout), None


def swiglu(h13_MI2: torch.Tensor, layout: ExpertLayout | None = None) -> torch.Tensor:
    """``silu(gate) * up`` on ``[M, 2I]`` (gate = first ``I`` columns) -> ``[M, I]``, same dtype.

    Saves only ``h13`` for backward. On CUDA with Triton only live rows are computed
    (DESIGN.md rule 3) and padding rows of the result and of its gradient stay unwritten;
    elsewhere every row is computed (padding rows give garbage, never read). Without a
    ``layout`` it is the plain torch expression (any rows, autograd of the torch ops).
    """
    if layout is None:
        gate, up = h13_MI2.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(h13_MI2, layout)


class _RecomputeBox:
    """Hands FC1's output recomputed by FC2's backward on to FC1's backward (runs right after)."""

    def __init__(self) -> None:
        self.h13: torch.Tensor | None = None


def _weighted(a_MI: torch.Tensor, row_w: torch.Tensor | None) -> torch.Tensor:
    return a_MI if row_w is None else a_MI * row_w.to(a_MI.dtype).unsqueeze(1)


class _FC1SwiGLU(torch.autograd.Function):
    """FC1 (gate||up) -> SwiGLU (× row weight) without saving the SwiGLU output.

    Saves the landed rows, plus ``h13`` unless ``recompute_fc1``. Returns ``(h, h13)``;
    ``h13`` is non-differentiable and only handed to :class:`_FC2Recompute` so that it can
    rebuild ``h`` (it is the same storage this node saved: no extra memory). With
    ``recompute_fc1`` ``h13`` is not returned (None) and FC2's backward recomputes it.
    """

    @staticmethod
    def forward(ctx, x_MH, w13, row_w, layout, backend, recompute_fc1, box):
        h13 = backend.gmm(x_MH, w13, layout)
        h = _weighted(_swiglu_fwd(h13, layout), row_w)
        ctx.layout, ctx.backend, ctx.recompute_fc1, ctx.box = layout, backend, recompute_fc1, box
        ctx.has_w = row_w is not None
        empty = x_MH.new_empty(0)
        ctx.save_for_backward(x_MH, w13, row_w if row_w is not None else empty,
                              empty if recompute_fc1 else h13)
        if recompute_fc1:
            return h, None
        ctx.mark_non_differentiable(h13)
        return h, h13

    @staticmethod
    def backward(ctx, dh_MI, _dh13):
        x, w13, row_w, h13 = ctx.saved_tensors
        layout, be = ctx.layout, ctx.backend
        if ctx.recompute_fc1:
            h13, ctx.box.h13 = ctx.box.h13, None
            if h13 is None:  # FC2's backward did not run first: recompute here
                h13 = be.gmm(x, w13, layout)
        d_row_w = None
        if ctx.has_w:
            a = _swiglu_fwd(h13, layout)
            # bf16 products summed in fp32: no [M, I] fp32 copies of dh and a (3 × M·I·4 bytes)
            d_row_w = torch.sum(dh_MI * a, dim=-1, dtype=torch.promote_types(a.dtype, torch.float32)).to(row_w.dtype)
            del a
            dh_MI = dh_MI * row_w.to(dh_MI.dtype).unsqueeze(1)
        dh13 = _swiglu_bwd(h13, dh_MI.contiguous(), layout)
        del h13, dh_MI
        dw13 = be.gmm_wgrad(x, dh13, layout).to(w13.dtype)
        dx = be.gmm(dh13, w13.transpose(1, 2), layout)
        return dx, dw13, d_row_w, None, None, None, None


class _FC2Recompute(torch.autograd.Function):
    """FC2 whose input ``h`` is not saved: backward rebuilds it from what FC1 saved.

    Saves (references to) the landed rows, ``w13``, the row weights and ``h13`` — tensors
    :class:`_FC1SwiGLU` already keeps — plus ``w2``. With ``recompute_fc1`` it reruns the FC1
    GEMM (+2·R·H·2I FLOPs) and leaves the result in the box for FC1's backward.
    """

    @staticmethod
    def forward(ctx, h_MI, w2, x_MH, w13, row_w, h13, layout, backend, box):
        ctx.layout, ctx.backend, ctx.box = layout, backend, box
        ctx.has_w, ctx.has_h13 = row_w is not None, h13 is not None
        empty = x_MH.new_empty(0)
        ctx.save_for_backward(w2, x_MH, w13, row_w if row_w is not None else empty,
                              h13 if h13 is not None else empty)
        return backend.gmm(h_MI, w2, layout)

    @staticmethod
    def backward(ctx, dy_MH):
        w2, x, w13, row_w, h13 = ctx.saved_tensors
        layout, be = ctx.layout, ctx.backend
        dy_MH = dy_MH.contiguous()
        if not ctx.has_h13:
            h13 = be.gmm(x, w13, layout)
            ctx.box.h13 = h13
        h = _weighted(_swiglu_fwd(h13, layout), row_w if ctx.has_w else None)
        del h13
        dw2 = be.gmm_wgrad(h, dy_MH, layout).to(w2.dtype)
        del h
        dh = be.gmm(dy_MH, w2.transpose(1, 2), layout)
        return dh, dw2, None, None, None, None, None, None, None


def expert_mlp_recompute(x_MH, w13, w2, row_w, layout, backend, recompute_fc1: bool) -> torch.Tensor:
    """FC1 -> SwiGLU (× row weight) -> FC2 with selective recompute (MegaBlocks' memory-optimised MLP idea).

    Saved for backward: the landed rows ``[M, H]``, ``h13 [M, 2I]`` unless ``recompute_fc1``,
    the row weights ``[M]`` if folded; never the SwiGLU output. Two autograd nodes, so that
    FC2's gradients are released before FC1's backward runs.
    """
    box = _RecomputeBox()
    h, h13 = _FC1SwiGLU.apply(x_MH, w13, row_w, layout, backend, recompute_fc1, box)
    return _FC2Recompute.apply(h, w2, x_MH, w13, row_w, h13, layout, backend, box)


class GroupedExperts(nn.Module):
    """``e`` local SwiGLU experts: ``y = (silu(x W_gate) * (x W_up)) W_down`` per expert.

    Parameters:
        w13: ``[e, H, 2I]`` fused gate||up (gate in the first ``I`` columns).
        w2: ``[e, I, H]`` down projection.
    Args:
        hidden_size: ``H``. moe_intermediate_size: ``I``. num_local_experts: ``e``.
        gemm: grouped GEMM backend name (:func:`dropless.ops.list_backends`).
        expert_offset: global id of local expert 0 (``ep_rank · e``), for layout-independent init.
        recompute_swiglu: do not save the SwiGLU output; recompute it from ``h13`` in backward.
        recompute_fc1: do not save ``h13`` either; rerun the FC1 GEMM in backward. Either
            option saves no more than the landed rows (plus ``h13`` for ``recompute_swiglu``).
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_local_experts: int,
                 gemm: str = "torch", expert_offset: int = 0, recompute_swiglu: bool = False,
                 recompute_fc1: bool = False):
        super().__init__()
        self.recompute_swiglu, self.recompute_fc1 = recompute_swiglu, recompute_fc1
        self.hidden_size, self.moe_intermediate_size = hidden_size, moe_intermediate_size
        self.num_local_experts, self.expert_offset = num_local_experts, expert_offset
        self.backend = get_backend(gemm)
        self.w13 = nn.Parameter(torch.empty(num_local_experts, hidden_size, 2 * moe_intermediate_size))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, moe_intermediate_size, hidden_size))

    def init_weights(self, seed: int, layer_id: int, std: float = 0.02) -> None:
        init_expert_weights_(self.w13, self.w2, seed, layer_id, self.expert_offset, std)

    def forward(self, rows_MH: torch.Tensor, layout: ExpertLayout,
                row_weight_M: torch.Tensor | None = None, poison: bool = False) -> torch.Tensor:
        """Run the experts on the live rows.

        Args:
            rows_MH: ``[M, H]`` landed rows (padding rows unspecified).
            layout: their :class:`ExpertLayout` (``e`` = ``num_local_experts``).
            row_weight_M: optional ``[M]`` routing weight per row, multiplied into the
                SwiGLU output before FC2 (``fold_routing_weights``).
            poison: debug: write NaN into the padding rows of every intermediate.
        Returns:
            ``[M, H]`` expert outputs in the compute dtype; padding rows unspecified.
        """
        dt = rows_MH.dtype
        if torch.is_autocast_enabled(rows_MH.device.type):
            dt = torch.get_autocast_dtype(rows_MH.device.type)
        x = rows_MH.to(dt)
        w13, w2 = self.w13.to(dt), self.w2.to(dt)
        with torch.autocast(rows_MH.device.type, enabled=False):
            if (self.recompute_fc1 or self.recompute_swiglu) and not poison:
                from dropless.ops.grouped_gemm import check_operands

                check_operands(x, w13, layout, self.backend)
                check_operands(x.new_empty(layout.capacity, w2.shape[1]), w2, layout, self.backend)
                return expert_mlp_recompute(x, w13, w2, row_weight_M, layout, self.backend,
                                            self.recompute_fc1)
            if poison:
                x = poison_padding(x, layout)
            h13 = grouped_mm(x, w13, layout, self.backend)
            if poison:
                h13 = poison_padding(h13, layout)
            h = swiglu(h13, layout)
            if row_weight_M is not None:
                h = h * row_weight_M.to(h.dtype).unsqueeze(1)
            if poison:
                h = poison_padding(h, layout)
            y = grouped_mm(h, w2, layout, self.backend)
            if poison:
                y = poison_padding(y, layout)
            return y
