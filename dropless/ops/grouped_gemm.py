"""Differentiable grouped GEMM over a live-row layout, and in-place weight-gradient accumulation.

:class:`WgradAccumulator` sums the weight gradients of one MoE layer call over its token
chunks (``num_token_chunks``) in a single buffer: the first chunk to run backward writes
it, every later one adds into it (the Triton kernel of :mod:`dropless.ops.triton_wgrad`
on CUDA, a GEMM with ``beta = 1``). Autograd's own accumulation would give each chunk a
fresh ``[e, K, N]`` gradient (a transient as large as the weight) and then add the two.

:class:`GradSink` takes a weight's gradient straight into an fp32 buffer the trainer owns (its
main gradient, :class:`dropless.train.grads.GradBuckets`): the weight-gradient kernel writes
or adds there in fp32, so a bf16 weight's gradient is neither rounded to bf16 nor copied into
fp32 afterwards (Megatron-Core calls this gradient-accumulation fusion).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dropless.layout import ExpertLayout
from dropless.ops.backends import GemmBackend, get_backend
from dropless.ops.backward import first_order_only, grad_wanted


class _GroupedMM(torch.autograd.Function):
    """out_MN = per-expert x_MK @ w_eKN over live rows; saves x and w (needed for dW and dX)."""

    @staticmethod
    def forward(ctx, x_MK, w_eKN, backend, layout, wgrad):
        ctx.backend, ctx.layout, ctx.wgrad = backend, layout, wgrad
        ctx.save_for_backward(x_MK, w_eKN)
        return backend.gmm(x_MK, w_eKN, layout)

    @staticmethod
    @first_order_only
    def backward(ctx, dy_MN):
        x_MK, w_eKN = ctx.saved_tensors
        # an expanded or non-contiguous upstream gradient (e.g. from .sum()) has zero or
        # odd strides that grouped_mm rejects: make it dense first.
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if grad_wanted(ctx, 0):
            dx = ctx.backend.gmm(dy_MN, w_eKN.transpose(1, 2), ctx.layout)
        if grad_wanted(ctx, 1):  # not when autograd.grad() asks for other inputs only
            dw = weight_grad(x_MK, dy_MN, ctx.layout, ctx.backend, w_eKN.dtype, ctx.wgrad)
        return dx, dw, None, None, None


def weight_grad(x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout, backend: GemmBackend,
                dtype: torch.dtype, wgrad: "tuple[WgradAccumulator, str] | None" = None) -> torch.Tensor | None:
    """The grouped weight gradient ``dW[i] = x[live_i]^T @ dy[live_i]`` of one layer call's GEMM.

    Args:
        x_MK: ``[M, K]`` the GEMM's input rows. dy_MN: ``[M, N]`` its output gradient.
        layout: the rows' layout. backend: the grouped GEMM backend computing ``dW`` (into the
            accumulator too). dtype: the weight's dtype.
        wgrad: ``(accumulator, name)`` to add ``dW`` into instead (chunked layer calls).
    Returns:
        ``[e, K, N]`` in ``dtype`` for autograd, or None after adding it into the accumulator.
    """
    if wgrad is not None:
        acc, name = wgrad
        acc.add(name, x_MK, dy_MN, layout, backend)
        return None
    return backend.gmm_wgrad(x_MK, dy_MN, layout).to(dtype)


def grouped_mm(x_MK: torch.Tensor, w_eKN: torch.Tensor, layout: ExpertLayout,
               backend: str | GemmBackend = "torch", wgrad: "tuple[WgradAccumulator, str] | None" = None
               ) -> torch.Tensor:
    """Grouped GEMM of the live rows of each local expert, with autograd.

    Args:
        x_MK: ``[M, K]`` landed rows (padding rows may hold anything, NaN included).
        w_eKN: ``[e, K, N]`` per-expert weights.
        layout: the rows' :class:`~dropless.layout.ExpertLayout` (``e`` experts, capacity ``M``).
        backend: a backend name from :func:`dropless.ops.list_backends` or an instance.
        wgrad: ``(accumulator, name)``: add ``dW`` into ``accumulator``'s buffer ``name``
            instead of returning it (``w_eKN`` must then come from
            :meth:`WgradAccumulator.collect`, which hands the sum to autograd).
    Returns:
        ``[M, N]`` in ``x_MK``'s dtype; live rows exact per expert, padding rows unspecified.
        Backward gives ``dX`` (live rows) and ``dW`` from live rows only (0 for empty experts).
    Raises:
        ValueError: shape mismatch, or the backend cannot run these operands.
    """
    if isinstance(backend, str):
        backend = get_backend(backend)
    check_operands(x_MK, w_eKN, layout, backend)
    return _GroupedMM.apply(x_MK, w_eKN, backend, layout, wgrad)


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


@dataclass(eq=False)
class GradSink:
    """An fp32 buffer that a weight's gradient goes into directly, instead of to autograd.

    The owner (the trainer's :class:`~dropless.train.grads.GradBuckets`) sets it as the
    parameter's ``main_grad_sink`` attribute; :meth:`GroupedExperts.weights
    <dropless.experts.GroupedExperts.weights>` finds it there and routes the weight's gradient
    through a :class:`WgradAccumulator` that writes ``buf``. Autograd then gets a placeholder
    gradient (an uninitialised tensor of the weight's shape and dtype, no kernel) so that the
    parameter's hooks still run, and the owner's hook, seeing ``wrote``, drops it.

    Attributes:
        buf: fp32 tensor of the weight's shape (the main gradient).
        active: the owner's switch: only while it is on (the trainer's backward passes) does a
            backward write ``buf``; otherwise the weight's gradient goes to autograd as usual
            (``torch.autograd.grad`` on the model, a backward outside a training step).
        fresh: True while ``buf`` holds no gradient of the current step: the next write
            overwrites it (an empty expert's rows become exact zeros), later writes add. The
            owner sets it at the start of a step and clears it when it writes ``buf`` itself.
        wrote: set when a backward wrote ``buf``; the owner clears it when it takes the gradient.

    Every use of the weight must go through the accumulator (as :class:`GroupedExperts
    <dropless.experts.GroupedExperts>` does): the placeholder would replace the gradient of
    any other use when autograd sums them.
    """

    buf: torch.Tensor
    active: bool = False
    fresh: bool = True
    wrote: bool = False

    def write(self, backend: GemmBackend, x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout) -> None:
        """``buf[i] = x[live_i]^T @ dy[live_i]`` if :attr:`fresh`, else ``+=`` (fp32, in place)."""
        if self.fresh:
            into = getattr(backend, "gmm_wgrad_into_", None)
            if into is not None:
                into(self.buf, x_MK, dy_MN, layout)
            else:
                self.buf.copy_(backend.gmm_wgrad(x_MK, dy_MN, layout))
        else:
            acc_ = getattr(backend, "gmm_wgrad_acc_", None)
            if acc_ is not None:
                acc_(self.buf, x_MK, dy_MN, layout)
            else:
                self.buf.add_(backend.gmm_wgrad(x_MK, dy_MN, layout))
        self.fresh, self.wrote = False, True


class _Collect(torch.autograd.Function):
    """Identity on a weight; its backward returns the accumulator's sum as the weight's gradient
    (or, where the gradient went to a :class:`GradSink`, a placeholder of the weight's shape)."""

    @staticmethod
    def forward(ctx, w, acc, name):
        ctx.acc, ctx.name = acc, name
        ctx.like = (w.shape, w.dtype, w.device)
        ctx.set_materialize_grads(False)
        return w.view_as(w)

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        dw = ctx.acc.pop(ctx.name)
        sink = ctx.acc.sinks.get(ctx.name)
        if sink is not None and sink.wrote:
            if grad is not None:  # a use of the weight outside the accumulator: into the sink too
                sink.buf.add_(grad)
            shape, dtype, device = ctx.like
            return torch.empty(shape, dtype=dtype, device=device), None, None
        if grad is not None:  # a use of the weight outside the accumulator
            dw = grad if dw is None else dw + grad
        return dw, None, None


class WgradAccumulator:
    """Sums the grouped-GEMM weight gradients of one layer call in place, over its chunks.

    Usage: ``w = acc.collect(param, "w13")`` once per layer call (before any cast), then
    ``grouped_mm(x, w.to(dt), layout, backend, wgrad=(acc, "w13"))`` (or :meth:`add` from a
    custom backward) once per chunk. In backward, the first chunk's ``dW`` becomes the
    buffer (in the parameter's dtype) and the later chunks add into it:
    :func:`dropless.ops.triton_wgrad.grouped_wgrad_` on CUDA (no transient ``[e, K, N]``,
    no extra pass), ``buffer += gmm_wgrad(...)`` elsewhere. The collect node, which runs
    after every chunk's backward, hands the buffer to autograd as the parameter's gradient.

    With ``sinks``, a named weight's gradient goes into its :class:`GradSink` instead (every
    chunk writes or adds there) and autograd gets a placeholder.

    Args:
        backend: the grouped GEMM backend computing the gradients.
        sinks: ``{name: GradSink}`` for the weights whose gradient goes to a sink.
    """

    def __init__(self, backend: GemmBackend, sinks: dict[str, GradSink] | None = None):
        self.backend = backend
        self.sinks = dict(sinks or {})
        self._grads: dict[str, torch.Tensor] = {}
        self._dtypes: dict[str, torch.dtype] = {}

    def collect(self, w: torch.Tensor, name: str) -> torch.Tensor:
        """Identity on ``w`` whose gradient will be buffer ``name`` (``w``'s dtype)."""
        self._dtypes[name] = w.dtype
        return _Collect.apply(w, self, name)

    def add(self, name: str, x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout,
            backend: GemmBackend | None = None) -> None:
        """``buffer[name][i] += x[live_i]^T @ dy[live_i]`` for every local expert ``i`` (or into its sink), computed
        by ``backend`` (default: the accumulator's; e.g. the bf16 ``torch`` backend where FP8 does not pay)."""
        be = self.backend if backend is None else backend
        sink = self.sinks.get(name)
        if sink is not None and sink.active:
            sink.write(be, x_MK, dy_MN, layout)
            return
        buf = self._grads.get(name)
        if buf is None:
            self._grads[name] = be.gmm_wgrad(x_MK, dy_MN, layout).to(self._dtypes[name])
            return
        acc_ = getattr(be, "gmm_wgrad_acc_", None)
        if acc_ is not None:
            acc_(buf, x_MK, dy_MN, layout)
        else:
            buf.add_(be.gmm_wgrad(x_MK, dy_MN, layout))

    def pop(self, name: str) -> torch.Tensor | None:
        return self._grads.pop(name, None)
