"""Differentiable grouped GEMM over a live-row layout."""

from __future__ import annotations

import torch

from dropless.layout import ExpertLayout
from dropless.ops.backends import GemmBackend, get_backend


class _GroupedMM(torch.autograd.Function):
    """out_MN = per-expert x_MK @ w_eKN over live rows; saves x and w (needed for dW and dX)."""

    @staticmethod
    def forward(ctx, x_MK, w_eKN, backend, layout):
        ctx.backend, ctx.layout = backend, layout
        ctx.save_for_backward(x_MK, w_eKN)
        return backend.gmm(x_MK, w_eKN, layout)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_eKN = ctx.saved_tensors
        # an expanded or non-contiguous upstream gradient (e.g. from .sum()) has zero or
        # odd strides that grouped_mm rejects: make it dense first.
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = ctx.backend.gmm(dy_MN, w_eKN.transpose(1, 2), ctx.layout)
        if ctx.needs_input_grad[1]:
            dw = ctx.backend.gmm_wgrad(x_MK, dy_MN, ctx.layout).to(w_eKN.dtype)
        return dx, dw, None, None


def grouped_mm(x_MK: torch.Tensor, w_eKN: torch.Tensor, layout: ExpertLayout,
               backend: str | GemmBackend = "torch") -> torch.Tensor:
    """Grouped GEMM of the live rows of each local expert, with autograd.

    Args:
        x_MK: ``[M, K]`` landed rows (padding rows may hold anything, NaN included).
        w_eKN: ``[e, K, N]`` per-expert weights.
        layout: the rows' :class:`~dropless.layout.ExpertLayout` (``e`` experts, capacity ``M``).
        backend: a backend name from :func:`dropless.ops.list_backends` or an instance.
    Returns:
        ``[M, N]`` in ``x_MK``'s dtype; live rows exact per expert, padding rows unspecified.
        Backward gives ``dX`` (live rows) and ``dW`` from live rows only (0 for empty experts).
    Raises:
        ValueError: shape mismatch, or the backend cannot run these operands.
    """
    if isinstance(backend, str):
        backend = get_backend(backend)
    check_operands(x_MK, w_eKN, layout, backend)
    return _GroupedMM.apply(x_MK, w_eKN, backend, layout)


def check_operands(x_MK: torch.Tensor, w_eKN: torch.Tensor, layout: ExpertLayout, backend: GemmBackend) -> None:
    """Raise ValueError when ``x_MK``/``w_eKN`` don't fit each other, the layout or the backend."""
    if x_MK.dim() != 2 or w_eKN.dim() != 3 or x_MK.shape[1] != w_eKN.shape[1]:
        raise ValueError(f"grouped_mm: need x [M, K] and w [e, K, N]; got {tuple(x_MK.shape)} and "
                         f"{tuple(w_eKN.shape)}")
    if w_eKN.shape[0] != layout.num_experts or x_MK.shape[0] != layout.capacity:
        raise ValueError(f"grouped_mm: w has {w_eKN.shape[0]} experts and x {x_MK.shape[0]} rows, but the "
                         f"layout has {layout.num_experts} experts and capacity {layout.capacity}")
    if x_MK.dtype != w_eKN.dtype:
        raise ValueError(f"grouped_mm: x is {x_MK.dtype} but w is {w_eKN.dtype}; cast one of them")
    backend.check(x_MK, w_eKN)
