"""The routed experts' FC1 -> SwiGLU (× row weight) -> FC2 in FP8 (``gemm=fp8``, ``gemm=deep_gemm``).

Forward: the landed rows are quantised (the backend's ``quant_act``: rowwise for ``fp8``,
1×128 for ``deep_gemm``; :func:`~dropless.ops.fp8_quant.quant_rows`), FC1 runs in FP8, the
SwiGLU output is quantised in the same pass that computes it (``swiglu_quant_act``:
:func:`~dropless.ops.fp8_quant.swiglu_quant_rows`; a folded routing weight multiplies the
row's scales, which is exact), and FC2 runs in FP8. Backward: the incoming gradient is
quantised the same way and both data gradients run in FP8; the weight gradients run in bf16
(:meth:`~dropless.ops.fp8_backend.Fp8Backend.gmm_wgrad`, or a chunk accumulator).

Two autograd nodes: FC1 (saves the landed rows ``[M, H]``, bf16, for ``dW13``) and SwiGLU-quant
+ FC2 (saves ``h13 [M, 2I]`` for the SwiGLU backward; the bf16 SwiGLU output for ``dW2`` is
rebuilt from it), plus the row weights if folded and the weights (their FP8 copies live in the
backend's per-step cache). This is what the bf16 path saves minus its ``[M, I]`` SwiGLU output;
FC2's gradients are released before FC1's backward runs.

Fused quantisation (``backend.fused_quant``, on by default for ``gemm=fp8``,
docs/performance.md#fp8-experts): FC2's output gradient is quantised
by the combine's backward that writes it (:mod:`dropless.ops.fp8_grad_rows`), and the ``local``
dispatcher lands FC1's codes in the gather that lands the rows
(:func:`~dropless.ops.fp8_rows.permute_fp8`): FC1 then saves the landed rows (``dW13`` reads
them as without it) and skips its quantisation pass. The codes and scales are the separate
passes' bit for bit.

FP8-landed rows (:class:`~dropless.ops.fp8_rows.Fp8Rows`, ``a2a``/``agrs`` dispatch): FC1
multiplies the landed codes and scales as they are (no quantisation pass over the landed
buffer) and saves them (1 byte per element) instead of the rows; its weight gradient ``dW13``
reads the dequantised codes ``q · s`` (the rows FC1 multiplied; the compute-dtype rows never
reach this rank), its data gradient is the same FP8 ``q(dY) @ q(W13ᵀ)`` as without FP8 dispatch,
returned for the stand-in input :func:`~dropless.ops.fp8_rows.grad_port`.

Rows given by their source (``recompute_gather``, a :class:`~dropless.ops.rows.RowSource`): FC1
lands them itself, with ``fused_quant`` as codes and scales only (each token quantised once and
its codes written to its ``k`` rows), saves the tokens and indices instead of the rows and lands
them again for ``dW13``. The SwiGLU output is never saved on any of these paths, so this node
keeps ``recompute_swiglu``'s and ``recompute_gather``'s memory with every quantisation in a kernel
that runs anyway.

Per-GEMM plan (:class:`~dropless.ops.fp8_policy.Fp8Plan`): a GEMM the plan keeps in bf16 runs
through the backend's bf16 ``torch`` backend (:attr:`~dropless.ops.fp8_backend.Fp8Backend.bf16`)
on the unquantised operand: FC1 on the rows (so no FP8-only landed rows), FC2 on the SwiGLU
output (× row weight), a data gradient on the incoming gradient, the weight gradients in bf16.
"""

from __future__ import annotations

import torch

from dropless.layout import ExpertLayout
from dropless.ops import fp8_grad_rows
from dropless.ops.backward import first_order_only, grad_wanted
from dropless.ops.fp8_backend import Fp8Backend
from dropless.ops.fp8_fused_rows import scatter_quant_rows
from dropless.ops.fp8_policy import ALL_FP8, Fp8Plan
from dropless.ops.fp8_quant import dequant_rows
from dropless.ops.fp8_rows import Fp8Rows
from dropless.ops.grouped_gemm import WgradAccumulator, weight_grad
from dropless.ops.rows import RowSource, gather_sum, land_rows
from dropless.ops.swiglu import swiglu_bwd, swiglu_fwd


class _Fp8FC1(torch.autograd.Function):
    """FC1 ``x @ W13`` with FP8 or bf16 forward / data gradient / weight gradient (``plan``).

    ``codes_MH``/``scales``: the rows as landed in FP8, or None to quantise ``x_MH`` here (FP8
    forward). ``rows_kept``: with codes, ``x_MH`` holds the rows themselves (the local gather's
    landing) and is saved for ``dW13``; without ``rows_kept`` it is a gradient port (values unused),
    the codes are saved and ``dW13`` reads ``q · s``. Without codes ``x_MH`` is saved.
    """

    @staticmethod
    def forward(ctx, x_MH, w13, codes_MH, scales, layout, backend, wgrad, rows_kept=False, plan=ALL_FP8):
        be: Fp8Backend = backend
        be.check_layout(layout)
        has_rows = codes_MH is None or rows_kept
        if plan.fc1:
            if codes_MH is None:
                codes_MH, scales = be.quant_act(x_MH, layout)
            h13 = be.scaled_gmm(codes_MH, scales, *be.weight(w13), layout, x_MH.dtype)
        else:
            if not has_rows:
                raise ValueError("FP8 FC1: rows landed as FP8 codes only cannot run FC1 in bf16; land the rows "
                                 "in the compute dtype where the plan runs FC1 in bf16")
            h13 = be.bf16.gmm(x_MH, w13, layout)
        ctx.layout, ctx.backend, ctx.wgrad, ctx.dtype, ctx.plan = layout, be, wgrad, x_MH.dtype, plan
        ctx.has_rows = has_rows
        if has_rows:
            ctx.save_for_backward(x_MH, w13)
        else:
            ctx.save_for_backward(codes_MH, scales, w13)
        return h13

    @staticmethod
    @first_order_only
    def backward(ctx, dh13):
        saved = ctx.saved_tensors
        w13 = saved[-1]
        be, layout, plan = ctx.backend, ctx.layout, ctx.plan
        dh13 = dh13.contiguous()
        dx = dw = None
        if grad_wanted(ctx, 0):  # q(dY) @ q(W13ᵀ), or bf16
            dx = (be if plan.fc1_dgrad else be.bf16).gmm(dh13, w13.transpose(1, 2), layout)
        if grad_wanted(ctx, 1):
            x_MH = saved[0] if ctx.has_rows else dequant_rows(saved[0], saved[1]).to(ctx.dtype)
            dw = weight_grad(x_MH, dh13, layout, be if plan.wgrad else be.bf16, w13.dtype,
                             (ctx.wgrad, "w13") if ctx.wgrad is not None else None)
        return dx, dw, None, None, None, None, None, None, None


class _Fp8GatherFC1(torch.autograd.Function):
    """Gather -> FC1 ``x[src] @ W13`` without saving the landed rows (``recompute_gather``); as :class:`_Fp8FC1`
    otherwise.

    Input: the source tokens ``x_NH [N, H]``. Forward, FC1 in FP8: with ``backend.fused_quant``
    the landing kernel writes only the codes and scales (each token read and quantised once,
    :func:`~dropless.ops.fp8_fused_rows.scatter_quant_rows`; no compute-dtype rows), else the
    rows are landed and quantised by ``quant_act``; FC1 in bf16: the rows are landed. Saves the
    tokens and the indices. Backward: ``dW13`` first, from the rows landed again (freed before
    ``dX``'s ``[M, H]`` rows are made), then ``dX`` on the rows summed over each token's ``k``
    copies (:func:`~dropless.ops.rows.gather_sum`, fp32 sum rounded once), ``[N, H]`` in the tokens'
    dtype. Raises as :func:`fp8_expert_mlp` (a non-finite live row: device-side, through the landing
    kernel's check).
    """

    @staticmethod
    def forward(ctx, x_NH, w13, src_M, dest_Nk, layout, backend, wgrad, plan=ALL_FP8):
        be: Fp8Backend = backend
        be.check_layout(layout)
        if plan.fc1 and be.fused_quant:
            _, codes_MH, scales = scatter_quant_rows(x_NH, src_M, dest_Nk, be.act_group, be.ue8m0, keep_rows=False)
            h13 = be.scaled_gmm(codes_MH, scales, *be.weight(w13), layout, x_NH.dtype)
        elif plan.fc1:
            codes_MH, scales = be.quant_act(land_rows(x_NH, src_M, dest_Nk), layout)
            h13 = be.scaled_gmm(codes_MH, scales, *be.weight(w13), layout, x_NH.dtype)
        else:
            h13 = be.bf16.gmm(land_rows(x_NH, src_M, dest_Nk), w13, layout)
        ctx.layout, ctx.backend, ctx.wgrad, ctx.plan = layout, be, wgrad, plan
        ctx.save_for_backward(x_NH, w13, src_M, dest_Nk)
        return h13

    @staticmethod
    @first_order_only
    def backward(ctx, dh13):
        x_NH, w13, src_M, dest_Nk = ctx.saved_tensors
        be, layout, plan = ctx.backend, ctx.layout, ctx.plan
        dh13 = dh13.contiguous()
        dx = dw = None
        if grad_wanted(ctx, 1):  # first: the landed rows never sit beside dX's [M, H] rows
            dw = weight_grad(land_rows(x_NH, src_M, dest_Nk), dh13, layout, be if plan.wgrad else be.bf16,
                             w13.dtype, (ctx.wgrad, "w13") if ctx.wgrad is not None else None)
        if grad_wanted(ctx, 0):
            dx_MH = (be if plan.fc1_dgrad else be.bf16).gmm(dh13, w13.transpose(1, 2), layout)
            del dh13
            dx = gather_sum(dx_MH, dest_Nk, None)
        return dx, dw, None, None, None, None, None, None


class _Fp8SwiGLUFC2(torch.autograd.Function):
    """SwiGLU (× row weight) quantised in one pass, then FC2 in FP8 (or both in bf16, ``plan.fc2`` False);
    saves ``h13`` (not the SwiGLU output)."""

    @staticmethod
    def forward(ctx, h13, w2, row_w, layout, backend, wgrad, plan=ALL_FP8):
        be: Fp8Backend = backend
        if plan.fc2:
            hq, hs = be.swiglu_quant_act(h13, layout)
            if row_w is not None:  # per-row scales: q(a)·(s·w) == a·w exactly up to q's rounding
                hs = be.fold_row_weight(hs, row_w.to(h13.dtype))
            y = be.scaled_gmm(hq, hs, *be.weight(w2), layout, h13.dtype)
        else:
            a = swiglu_fwd(h13, layout)
            if row_w is not None:
                a = a * row_w.to(a.dtype).unsqueeze(1)
            y = be.bf16.gmm(a, w2, layout)
        ctx.layout, ctx.backend, ctx.wgrad, ctx.has_w, ctx.plan = layout, be, wgrad, row_w is not None, plan
        # the combine's backward writes dy's rows: it quantises them there (fp8_grad_rows)
        ctx.codes = fp8_grad_rows.ask(y, be.act_group, be.ue8m0) if be.fused_quant and plan.fc2_dgrad else None
        ctx.save_for_backward(h13, w2, row_w if row_w is not None else h13.new_empty(0))
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy_MH):
        h13, w2, row_w = ctx.saved_tensors
        layout, be, acc, plan = ctx.layout, ctx.backend, ctx.wgrad, ctx.plan
        row_w = row_w if ctx.has_w else None
        want_h, want_w2 = grad_wanted(ctx, 0), grad_wanted(ctx, 1)
        want_rw = ctx.has_w and grad_wanted(ctx, 2)
        fused = ctx.codes.take(dy_MH) if ctx.codes is not None else None
        dy_MH = dy_MH.contiguous()
        dh13 = dw2 = d_row_w = a = None
        if want_h or want_rw:
            if plan.fc2_dgrad:
                dyq, dys = fused if fused is not None else be.quant_act(dy_MH, layout)
                dh = be.scaled_gmm(dyq, dys, *be.weight(w2.transpose(1, 2)), layout, dy_MH.dtype)  # d(a · w)
                del dyq, dys
            else:
                dh = be.bf16.gmm(dy_MH, w2.transpose(1, 2), layout)
            if want_rw:
                a = swiglu_fwd(h13, layout)
                d_row_w = torch.sum(dh * a, dim=-1, dtype=torch.float32).to(row_w.dtype)
            if want_h:  # before dW2, so that dh is freed first
                dh13 = swiglu_bwd(h13, dh, layout, row_w)
            del dh
        if want_w2:
            if a is None:
                a = swiglu_fwd(h13, layout)
            if row_w is not None:
                a = a.mul_(row_w.to(a.dtype).unsqueeze(1))
            dw2 = weight_grad(a, dy_MH, layout, be if plan.wgrad else be.bf16, w2.dtype,
                              (acc, "w2") if acc is not None else None)
        return dh13, dw2, d_row_w, None, None, None, None


@torch.compiler.disable  # the weight cache (identity, _version) is host logic: run eagerly inside a compiled graph
def fp8_expert_mlp(x_MH: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, row_w: torch.Tensor | None,
                   layout: ExpertLayout, backend: Fp8Backend, wgrad: WgradAccumulator | None = None,
                   landed: Fp8Rows | None = None, plan: Fp8Plan = ALL_FP8,
                   source: RowSource | None = None) -> torch.Tensor:
    """FC1 -> SwiGLU (× row weight) -> FC2 of the live rows with FP8 GEMMs.

    Two autograd nodes: FC1 (saves the rows, or the landed codes) and SwiGLU-quant + FC2 (saves
    ``h13``), so that FC2's backward releases its gradients and ``h13`` before FC1's backward runs.

    Args:
        x_MH: ``[M, H]`` landed rows (bf16; padding rows may hold anything, NaN included); with
            ``landed``, the dispatcher's :func:`~dropless.ops.fp8_rows.grad_port` (values unused);
            with ``source``, None.
        w13: ``[e, H, 2I]``, w2: ``[e, I, H]`` in ``x_MH``'s dtype (their FP8 copies come from
            ``backend``'s cache: made once per optimizer step).
        row_w: ``[M]`` routing weight per row (``fold_routing_weights``), or None.
        layout: the rows' :class:`ExpertLayout`. backend: an :class:`Fp8Backend`.
        wgrad: accumulator for ``dW13``/``dW2`` (chunked layer calls), or None to return them.
        landed: the rows as the dispatcher landed them in FP8 (codes + scales of the backend's
            ``quant_act``), or None to quantise ``x_MH`` here; its codes are taken over
            (:meth:`~dropless.ops.fp8_rows.Fp8Rows.release`). With ``landed.rows_kept``
            (``local``'s :func:`~dropless.ops.fp8_rows.permute_fp8`) ``x_MH`` holds the rows.
        plan: which GEMMs run in FP8 (:func:`~dropless.ops.fp8_policy.plan_fp8`); the others run
            in bf16 through the ``torch`` backend. FC1 in bf16 needs the rows (not FP8-only ``landed``).
        source: the rows' :class:`~dropless.ops.rows.RowSource` (``recompute_gather``): FC1 lands them
            itself (as codes only, with ``backend.fused_quant``) and lands them again for ``dW13``
            in backward; nothing ``[M, H]`` is saved, and ``dX`` is per source token (``[N, H]``).
    Returns:
        ``[M, H]`` in ``x_MH``'s dtype; live rows per expert, padding rows unspecified. Backward:
        ``dX`` on live rows (FP8 data gradients), ``dW`` from live rows only in bf16 (exactly 0
        for an empty expert), ``d row_w``.
    Raises:
        ValueError: both ``source`` and ``landed``.
        RuntimeError: (device-side, asynchronous on CUDA) a live row of an FP8 operand is not finite.
    Under ``torch.compile`` it runs eagerly (a graph break; ``fullgraph=True`` refuses it).
    """
    if source is not None:
        if landed is not None:
            raise ValueError("fp8_expert_mlp: give the rows' source or their FP8 landing, not both")
        h13 = _Fp8GatherFC1.apply(source.x_NH, w13, source.src_M, source.dest_Nk, layout, backend, wgrad, plan)
        return _Fp8SwiGLUFC2.apply(h13, w2, row_w, layout, backend, wgrad, plan)
    codes, scales, kept = landed.release() if landed is not None else (None, None, False)
    h13 = _Fp8FC1.apply(x_MH, w13, codes, scales, layout, backend, wgrad, kept, plan)
    del codes, scales  # with rows_kept nothing holds the codes any more: freed before FC2 runs
    return _Fp8SwiGLUFC2.apply(h13, w2, row_w, layout, backend, wgrad, plan)
