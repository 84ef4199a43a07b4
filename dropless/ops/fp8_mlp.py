"""The routed experts' FC1 -> SwiGLU (× row weight) -> FC2 in FP8, as one autograd node (``gemm=fp8``).

Forward: the landed rows are quantised rowwise (:func:`~dropless.ops.fp8_quant.quant_rows`),
FC1 runs in FP8, the SwiGLU output is quantised in the same pass that computes it
(:func:`~dropless.ops.fp8_quant.swiglu_quant_rows`; a folded routing weight multiplies the
row's scale, which is exact for rowwise scales), and FC2 runs in FP8. Backward: the incoming
gradient is quantised rowwise and both data gradients run in FP8; the weight gradients run
in bf16 (:meth:`~dropless.ops.fp8_backend.Fp8Backend.gmm_wgrad`, or a chunk accumulator).

Saved for backward: the landed rows ``[M, H]`` (bf16, for ``dW13``), ``h13 [M, 2I]`` (for the
SwiGLU backward; the bf16 SwiGLU output for ``dW2`` is rebuilt from it), the row weights if
folded, and the weights (their FP8 copies live in the backend's per-step cache). This is
what the bf16 path saves minus its ``[M, I]`` SwiGLU output.
"""

from __future__ import annotations

import torch

from dropless.layout import ExpertLayout
from dropless.ops.backward import first_order_only, grad_wanted
from dropless.ops.fp8_backend import Fp8Backend
from dropless.ops.fp8_quant import quant_rows, swiglu_quant_rows
from dropless.ops.grouped_gemm import WgradAccumulator, weight_grad
from dropless.ops.swiglu import swiglu_bwd, swiglu_fwd


class _Fp8ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MH, w13, w2, row_w, layout, backend, wgrad):
        be: Fp8Backend = backend
        xq, xs = quant_rows(x_MH, layout, be.ue8m0)
        h13 = be.scaled_gmm(xq, xs, *be.weight(w13), layout, x_MH.dtype)
        del xq, xs
        hq, hs = swiglu_quant_rows(h13, layout, be.ue8m0)
        if row_w is not None:  # rowwise scales: q(a)·(s·w) == a·w exactly up to q's rounding
            hs = hs * row_w.to(h13.dtype).float()
        y = be.scaled_gmm(hq, hs, *be.weight(w2), layout, x_MH.dtype)
        ctx.layout, ctx.backend, ctx.wgrad, ctx.has_w = layout, be, wgrad, row_w is not None
        ctx.save_for_backward(x_MH, h13, w13, w2, row_w if row_w is not None else x_MH.new_empty(0))
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy_MH):
        x, h13, w13, w2, row_w = ctx.saved_tensors
        layout, be, acc = ctx.layout, ctx.backend, ctx.wgrad
        row_w = row_w if ctx.has_w else None
        want_x, want_w13, want_w2 = grad_wanted(ctx, 0), grad_wanted(ctx, 1), grad_wanted(ctx, 2)
        want_rw = ctx.has_w and grad_wanted(ctx, 3)
        dy_MH = dy_MH.contiguous()
        dx = dw13 = dw2 = d_row_w = None
        need_dh = want_x or want_w13 or want_rw
        dh = None
        if need_dh:
            dyq, dys = quant_rows(dy_MH, layout, be.ue8m0)
            dh = be.scaled_gmm(dyq, dys, *be.weight(w2.transpose(1, 2)), layout, dy_MH.dtype)  # d(a · w)
            del dyq, dys
        if want_w2 or want_rw:
            a = swiglu_fwd(h13, layout)
            if want_rw:
                d_row_w = torch.sum(dh * a, dim=-1, dtype=torch.float32).to(row_w.dtype)
            if want_w2:
                if row_w is not None:
                    a = a.mul_(row_w.to(a.dtype).unsqueeze(1))
                dw2 = weight_grad(a, dy_MH, layout, be, w2.dtype, (acc, "w2") if acc is not None else None)
            del a
        del dy_MH
        if want_x or want_w13:
            dh13 = swiglu_bwd(h13, dh, layout, row_w)
            del dh, h13
            if want_w13:
                dw13 = weight_grad(x, dh13, layout, be, w13.dtype, (acc, "w13") if acc is not None else None)
            if want_x:
                dq, ds = quant_rows(dh13, layout, be.ue8m0)
                del dh13
                dx = be.scaled_gmm(dq, ds, *be.weight(w13.transpose(1, 2)), layout, x.dtype)
        return dx, dw13, dw2, d_row_w, None, None, None


@torch.compiler.disable  # the weight cache (identity, _version) is host logic: run eagerly inside a compiled graph
def fp8_expert_mlp(x_MH: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, row_w: torch.Tensor | None,
                   layout: ExpertLayout, backend: Fp8Backend, wgrad: WgradAccumulator | None = None) -> torch.Tensor:
    """FC1 -> SwiGLU (× row weight) -> FC2 of the live rows with FP8 GEMMs.

    Args:
        x_MH: ``[M, H]`` landed rows (bf16; padding rows may hold anything, NaN included).
        w13: ``[e, H, 2I]``, w2: ``[e, I, H]`` in ``x_MH``'s dtype (their FP8 copies come from
            ``backend``'s cache: made once per optimizer step).
        row_w: ``[M]`` routing weight per row (``fold_routing_weights``), or None.
        layout: the rows' :class:`ExpertLayout`. backend: an :class:`Fp8Backend`.
        wgrad: accumulator for ``dW13``/``dW2`` (chunked layer calls), or None to return them.
    Returns:
        ``[M, H]`` in ``x_MH``'s dtype; live rows per expert, padding rows unspecified. Backward:
        ``dX`` on live rows (FP8 data gradients), ``dW`` from live rows only in bf16 (exactly 0
        for an empty expert), ``d row_w``.
    Raises:
        RuntimeError: (device-side, asynchronous on CUDA) a live row of an FP8 operand is not finite.
    Under ``torch.compile`` it runs eagerly (a graph break; ``fullgraph=True`` refuses it).
    """
    return _Fp8ExpertMLP.apply(x_MH, w13, w2, row_w, layout, backend, wgrad)
