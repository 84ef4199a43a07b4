"""RMSNorm, with its input and weight gradients in one pass over ``dy`` and ``x``; and a residual add fused with it.

:func:`rms_norm` is the op :class:`dropless.model.norm.RMSNorm` calls: ``F.rms_norm`` forward, and on
the Triton path an autograd Function whose backward is :func:`rms_norm_backward`.
:func:`add_rms_norm` is a pre-norm block's residual add and the next norm, ``h = x + a``,
``y = rms_norm(h)``: on the Triton path one kernel reads ``x`` and ``a`` and writes ``h`` and ``y``
(:func:`add_rms_norm_forward`), and the backward adds ``h``'s own gradient into ``dx`` inside
:func:`rms_norm_backward`'s kernel (``residual_grad``), so neither the add nor autograd's sum of the
two gradients of ``h`` runs as a kernel of its own.

For ``y = x · rstd · w`` with ``rstd = 1 / sqrt(mean(x²) + eps)`` over the last dimension (Zhang &
Sennrich 2019), the derivative of RMSNorm (differentiate ``y_j = w_j x_j rstd`` and
``∂rstd/∂x_i = −rstd³ x_i / D``), written with ``x̂ = x · rstd`` and ``g = dy · w``:

    ``dx = rstd · (g − x̂ · mean(g · x̂))``            (per row, mean over the D features)
    ``dw = Σ_rows dy · x̂``

:func:`rms_norm_backward` recomputes ``rstd`` from ``x`` (nothing is saved but ``x`` and ``w``) and
computes in fp32 (fp64 for fp64 inputs). The Triton kernel runs a grid of a few programs per SM, each
over a contiguous range of rows in blocks of whole rows: it writes ``dx`` for its rows and keeps its
part of ``dw`` in fp32 registers, stored once as a row of ``[G, D]`` partials that one ``sum(0)`` adds
(deterministic: no atomics; no host sync). The torch reference (CPU, float64, and the differentiable
backward of a ``create_graph`` backward) is the same formula in torch ops.
:func:`dropless.ops.select.use_triton` picks.

Shape letters: R rows, D features (the normalised dimension), G programs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dropless.ops import select

__all__ = ["rms_norm", "rms_norm_backward", "rms_norm_backward_torch", "add_rms_norm", "add_rms_norm_forward"]

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, dr_ptr, dx_ptr, dwp_ptr, R, rows_per_prog, stride_dy, stride_x,
                             stride_dr, eps, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                             STAGES: tl.constexpr, HAS_DR: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)  # this program's dw, per row slot
        lo = pid * rows_per_prog
        hi = tl.minimum(lo + rows_per_prog, R)
        for r0 in tl.range(lo, hi, BLOCK_R, num_stages=STAGES):
            rows = r0 + tl.arange(0, BLOCK_R)
            mask = (rows < hi)[:, None] & cmask[None, :]
            r64 = rows.to(tl.int64)[:, None]
            x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            xhat = x * rstd
            g = dy * w
            c = tl.sum(g * xhat, axis=1)[:, None] / D
            dx = rstd * (g - xhat * c)
            if HAS_DR:  # the residual's own gradient, added before the one rounding
                dx += tl.load(dr_ptr + r64 * stride_dr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + r64 * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            acc += dy * xhat
        tl.store(dwp_ptr + pid * D + cols, tl.sum(acc, axis=0), mask=cmask)

    @triton.jit
    def _add_rms_norm_fwd_kernel(x_ptr, a_ptr, w_ptr, h_ptr, y_ptr, R, rows_per_prog, stride_x, stride_a, eps,
                                 D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        lo = pid * rows_per_prog
        hi = tl.minimum(lo + rows_per_prog, R)
        for r0 in tl.range(lo, hi, BLOCK_R, num_stages=STAGES):
            rows = r0 + tl.arange(0, BLOCK_R)
            mask = (rows < hi)[:, None] & cmask[None, :]
            r64 = rows.to(tl.int64)[:, None]
            x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + r64 * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = (x + a).to(h_ptr.dtype.element_ty)  # rounded as torch's add rounds; the norm reads this h
            tl.store(h_ptr + r64 * D + cols[None, :], h, mask=mask)
            hf = h.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / D + eps)[:, None]
            tl.store(y_ptr + r64 * D + cols[None, :], (hf * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_backward_torch(dy_RD: torch.Tensor, x_RD: torch.Tensor, weight_D: torch.Tensor,
                            eps: float, residual_grad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`rms_norm_backward` in torch ops (differentiable; fp32 temporaries, float64 for
    float64 inputs)."""
    acc = torch.promote_types(torch.promote_types(x_RD.dtype, weight_D.dtype), torch.float32)
    x = x_RD.to(acc)
    dy = dy_RD.to(acc)
    rstd_R1 = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    xhat = x * rstd_R1
    g = dy * weight_D.to(acc)
    dx = rstd_R1 * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if residual_grad is not None:
        dx = dx + residual_grad.to(acc)
    return dx.to(x_RD.dtype), (dy * xhat).sum(0).to(weight_D.dtype)


def _launch_config(d: int) -> tuple[int, int, int, int]:
    """``(BLOCK_R, num_warps, programs per SM, pipeline stages)`` for ``D = d``: blocks of about 4,096
    elements (one row at a time from ``D`` = 4,097), 16 elements a thread, as many programs as fit on an
    SM at once (about 128 registers a thread), the next two blocks' loads issued while this one is computed."""
    block_d = triton.next_power_of_2(d)
    block_r = max(1, 4096 // block_d)
    num_warps = min(16, max(4, block_r * block_d // 512))
    return block_r, num_warps, max(1, 16 // num_warps), 3


def rms_norm_backward(dy_RD: torch.Tensor, x_RD: torch.Tensor, weight_D: torch.Tensor, eps: float, *,
                      residual_grad: torch.Tensor | None = None,
                      config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of ``y = rms_norm(x) · weight`` given ``dy``, in one pass over ``dy`` and ``x``.

    Args:
        dy_RD, x_RD: ``[R, D]`` of one dtype (bf16, fp16, fp32; float64 runs the torch reference), any
            ``R`` (0 included); rows may be strided, columns are made contiguous if they are not.
        weight_D: ``[D]``, ``x``'s dtype or fp32.
        eps: added to the mean square before the rsqrt (the forward's).
        residual_grad: ``[R, D]`` in ``x``'s dtype or None: a second gradient of ``x`` (a residual
            stream's), added to ``dx`` in fp32 before its one rounding.
        config: ``(BLOCK_R, num_warps, programs per SM, pipeline stages)`` for the kernel (benchmarks);
            None: the default.
    Returns:
        ``dx_RD`` contiguous in ``x``'s dtype, ``dweight_D`` in ``weight``'s dtype (summed in fp32,
        rounded once).
    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    _check_rows("rms_norm_backward", x_RD, "dy", dy_RD, weight_D)
    if residual_grad is not None and (residual_grad.shape != x_RD.shape or residual_grad.dtype != x_RD.dtype):
        raise ValueError(f"rms_norm_backward: residual_grad must be x's shape and dtype, got "
                         f"{tuple(residual_grad.shape)} {residual_grad.dtype} for x {tuple(x_RD.shape)} {x_RD.dtype}")
    if not select.use_triton(x_RD) or x_RD.dtype == torch.float64:
        dx_RD, dw_D = rms_norm_backward_torch(dy_RD, x_RD, weight_D, eps, residual_grad)
        return dx_RD.contiguous(), dw_D
    dy_RD, x_RD = (t if t.stride(1) == 1 else t.contiguous() for t in (dy_RD, x_RD))
    dr = residual_grad if residual_grad is None or residual_grad.stride(1) == 1 else residual_grad.contiguous()
    r, d = x_RD.shape
    dx_RD = torch.empty((r, d), dtype=x_RD.dtype, device=x_RD.device)
    if r == 0 or d == 0:
        return dx_RD, torch.zeros_like(weight_D)
    block_r, num_warps, stages, g, rows_per_prog = _grid(r, d, x_RD, config)
    dw_GD = torch.empty((g, d), dtype=torch.float32, device=x_RD.device)
    _rms_norm_bwd_kernel[(g,)](dy_RD, x_RD, weight_D.contiguous(), dr if dr is not None else x_RD, dx_RD, dw_GD, r,
                               rows_per_prog, dy_RD.stride(0), x_RD.stride(0), dr.stride(0) if dr is not None else 0,
                               float(eps), D=d, BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(d), STAGES=stages,
                               HAS_DR=dr is not None, num_warps=num_warps)
    return dx_RD, dw_GD.sum(0).to(weight_D.dtype)


def _check_rows(fn: str, x_RD: torch.Tensor, name: str, other_RD: torch.Tensor, weight_D: torch.Tensor) -> None:
    """ValueError unless ``x`` and ``other`` are ``[R, D]`` of one dtype and ``weight`` is ``[D]`` in ``x``'s dtype
    or fp32 (``fn``, ``name``: the function and ``other``'s argument, for the message)."""
    if not x_RD.is_floating_point():
        raise ValueError(f"{fn}: x must be a floating-point tensor (bf16, fp16, fp32, fp64), got {x_RD.dtype}")
    if x_RD.dim() != 2 or other_RD.shape != x_RD.shape or weight_D.shape != (x_RD.shape[1],):
        raise ValueError(f"{fn}: x and {name} must be [R, D] with weight [D]; got x {tuple(x_RD.shape)}, "
                         f"{name} {tuple(other_RD.shape)}, weight {tuple(weight_D.shape)}")
    if other_RD.dtype != x_RD.dtype or weight_D.dtype not in (x_RD.dtype, torch.float32):
        raise ValueError(f"{fn}: {name} must have x's dtype and weight x's or fp32; got x {x_RD.dtype}, "
                         f"{name} {other_RD.dtype}, weight {weight_D.dtype}")


def _check_weight(fn: str, x_xD: torch.Tensor, weight_D: torch.Tensor) -> None:
    """ValueError unless ``weight`` is ``[D]`` for ``x`` ``[..., D]`` (the same message on every path)."""
    if weight_D.dim() != 1 or x_xD.dim() == 0 or weight_D.shape[0] != x_xD.shape[-1]:
        raise ValueError(f"{fn}: weight must be [D] for x [..., D]; got weight {tuple(weight_D.shape)}, "
                         f"x {tuple(x_xD.shape)}")


def _grid(r: int, d: int, x: torch.Tensor, config: tuple[int, int, int, int] | None) -> tuple[int, int, int, int, int]:
    """``(BLOCK_R, num_warps, stages, programs, rows per program)`` over ``r`` rows of ``d`` features."""
    block_r, num_warps, per_sm, stages = config or _launch_config(d)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2
    blocks = -(-r // block_r)
    rows_per_prog = -(-blocks // min(blocks, sms * per_sm)) * block_r   # whole blocks per program
    return block_r, num_warps, stages, -(-r // rows_per_prog), rows_per_prog


def add_rms_norm_forward(x_RD: torch.Tensor, a_RD: torch.Tensor, weight_D: torch.Tensor, eps: float, *,
                         config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, y)`` with ``h = x + a`` and ``y = rms_norm(h) · weight``, in one pass over ``x`` and ``a``.

    Args:
        x_RD, a_RD: ``[R, D]`` of one dtype (bf16, fp16, fp32; float64 runs the torch ops); rows may be
            strided, columns are made contiguous if they are not.
        weight_D: ``[D]``, ``x``'s dtype or fp32.
        eps: added to the mean square before the rsqrt.
        config: as :func:`rms_norm_backward`'s.
    Returns:
        ``h_RD`` and ``y_RD``, contiguous, in ``x``'s dtype. ``h`` is the sum rounded once (as torch's
        ``x + a``) and ``y`` is normalised from that rounded ``h`` in fp32 (``h · rstd · w``, rounded
        once), as :func:`rms_norm` of it computes, up to the order of the mean square's sum.
    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    _check_rows("add_rms_norm_forward", x_RD, "a", a_RD, weight_D)
    if not select.use_triton(x_RD) or x_RD.dtype == torch.float64:
        h_RD = x_RD + a_RD
        return h_RD, _rms_norm(h_RD, weight_D, eps)
    x_RD, a_RD = (t if t.stride(1) == 1 else t.contiguous() for t in (x_RD, a_RD))
    r, d = x_RD.shape
    h_RD = torch.empty((r, d), dtype=x_RD.dtype, device=x_RD.device)
    y_RD = torch.empty_like(h_RD)
    if r == 0 or d == 0:
        return h_RD, y_RD
    block_r, num_warps, stages, g, rows_per_prog = _grid(r, d, x_RD, config)
    _add_rms_norm_fwd_kernel[(g,)](x_RD, a_RD, weight_D.contiguous(), h_RD, y_RD, r, rows_per_prog, x_RD.stride(0),
                                   a_RD.stride(0), float(eps), D=d, BLOCK_R=block_r,
                                   BLOCK_D=triton.next_power_of_2(d), STAGES=stages, num_warps=num_warps)
    return h_RD, y_RD


def _rms_norm(x_xD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm`` in ``promote_types(x.dtype, float32)``, in ``x``'s dtype (16-bit ``x`` with a weight of its
    own dtype as it is: torch's kernels compute in fp32 and round once)."""
    if x_xD.dtype in (torch.bfloat16, torch.float16) and weight_D.dtype == x_xD.dtype:
        return F.rms_norm(x_xD, weight_D.shape, weight_D, eps)
    compute_dtype = torch.promote_types(x_xD.dtype, torch.float32)
    return F.rms_norm(x_xD.to(compute_dtype), weight_D.shape, weight_D.to(compute_dtype), eps).to(x_xD.dtype)


class _RMSNormFn(torch.autograd.Function):
    """:func:`_rms_norm` whose backward is :func:`rms_norm_backward` (one kernel for ``dx`` and ``dweight``);
    saves ``x`` and ``weight`` only. A ``create_graph`` backward (grad mode on), and a gradient in another
    dtype than ``x`` (an autocast forward), run the differentiable torch reference instead."""

    @staticmethod
    def forward(ctx, x_xD, weight_D, eps):
        ctx.save_for_backward(x_xD, weight_D)
        ctx.eps = eps
        return _rms_norm(x_xD, weight_D, eps)

    @staticmethod
    def backward(ctx, dy_xD):
        x_xD, weight_D = ctx.saved_tensors
        bwd = rms_norm_backward_torch if torch.is_grad_enabled() or dy_xD.dtype != x_xD.dtype else rms_norm_backward
        D = weight_D.shape[0]
        dx_RD, dw_D = bwd(dy_xD.reshape(-1, D), x_xD.reshape(-1, D), weight_D, ctx.eps)
        return dx_RD.reshape(x_xD.shape), dw_D, None


def _backward_kernel_path(x_xD: torch.Tensor, weight_D: torch.Tensor, *others: torch.Tensor) -> bool:
    """True where the norms' autograd Functions run (their backward the Triton kernel): grad mode on, ``x``
    bf16/fp16/fp32 with ``D > 0`` on the Triton path, the weight ``x``'s dtype or fp32, neither compiling
    (inductor generates its own backward) nor under ``torch.func`` transforms."""
    return (torch.is_grad_enabled() and x_xD.shape[-1] > 0
            and x_xD.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weight_D.dtype in (x_xD.dtype, torch.float32) and select.use_triton(x_xD)
            and not torch.compiler.is_compiling()
            and not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in (x_xD, weight_D, *others)))


def rms_norm(x_xD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps) · weight`` over the last dim in ``promote_types(x.dtype, float32)``, in
    ``x``'s dtype (16-bit ``x`` with a weight of its own dtype goes to ``F.rms_norm`` as it is: its kernels
    compute in fp32 and round once).

    The forward is ``F.rms_norm``. Backward: where :func:`dropless.ops.select.use_triton` takes ``x``
    (CUDA), ``x`` is bf16/fp16/fp32 and the weight ``x``'s dtype or fp32, with grad mode on and neither
    compiling (inductor generates its own backward) nor under ``torch.func`` transforms, an autograd
    Function that saves only ``x`` and the weight and runs :func:`rms_norm_backward` (one kernel; last-bit
    differences from torch's backward). Everywhere else autograd differentiates ``F.rms_norm``.
    """
    _check_weight("rms_norm", x_xD, weight_D)
    if _backward_kernel_path(x_xD, weight_D):
        return _RMSNormFn.apply(x_xD, weight_D, eps)
    return _rms_norm(x_xD, weight_D, eps)


class _AddRMSNormFn(torch.autograd.Function):
    """``(h, y) = (x + a, rms_norm(x + a))`` by :func:`add_rms_norm_forward`; saves ``h`` and the weight.

    Backward: ``dx = da = dh + d(rms_norm)/dh · dy`` from :func:`rms_norm_backward` with
    ``residual_grad = dh`` (one kernel), returned for both ``x`` and ``a`` (as autograd's add does).
    A ``create_graph`` backward, or a gradient in another dtype than ``h``, runs the torch reference.
    """

    @staticmethod
    def forward(ctx, x_xD, a_xD, weight_D, eps):
        D = weight_D.shape[0]
        h_RD, y_RD = add_rms_norm_forward(x_xD.reshape(-1, D), a_xD.reshape(-1, D), weight_D, eps)
        h_xD = h_RD.view(x_xD.shape)
        ctx.save_for_backward(h_xD, weight_D)  # an output: a create_graph backward differentiates through it
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        return h_xD, y_RD.view(x_xD.shape)

    @staticmethod
    def backward(ctx, dh_xD, dy_xD):
        h_xD, weight_D = ctx.saved_tensors
        if dy_xD is None:
            return dh_xD, dh_xD, None, None
        D = weight_D.shape[0]
        h_RD = h_xD.reshape(-1, D)
        dr = None if dh_xD is None else dh_xD.reshape(-1, D)
        fast = not torch.is_grad_enabled() and dy_xD.dtype == h_RD.dtype and (dr is None or dr.dtype == h_RD.dtype)
        bwd = rms_norm_backward if fast else rms_norm_backward_torch
        if fast:
            dx_RD, dw_D = bwd(dy_xD.reshape(-1, D), h_RD, weight_D, ctx.eps, residual_grad=dr)
        else:
            dx_RD, dw_D = bwd(dy_xD.reshape(-1, D), h_RD, weight_D, ctx.eps)
            dx_RD = dx_RD if dr is None else dx_RD + dr
        dx_xD = dx_RD.view(h_xD.shape)
        return dx_xD, dx_xD, dw_D, None


def add_rms_norm(x_xD: torch.Tensor, a_xD: torch.Tensor, weight_D: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the norm after it: ``h = x + a`` and ``y = rms_norm(h, weight, eps)``.

    Args:
        x_xD, a_xD: ``[..., D]``, one shape and dtype (the residual stream and the branch's output).
        weight_D: ``[D]``. eps: as :func:`rms_norm`'s.
    Returns:
        ``(h, y)``, ``[..., D]`` in ``x``'s dtype (where ``a``'s differs, the plain ops' promoted dtype).

    Where :func:`rms_norm` takes its autograd Function (CUDA, grad mode on, not compiling, not
    under ``torch.func``) and ``x``, ``a`` match in shape and dtype, :class:`_AddRMSNormFn`: one
    kernel forward and one backward (``h``'s own gradient added inside the norm's backward
    kernel; last-bit differences from the separate ops, which round ``dx`` twice). Everywhere
    else the plain ``x + a`` and :func:`rms_norm`, which the compiler fuses on its own.
    """
    _check_weight("add_rms_norm", x_xD, weight_D)
    if a_xD.shape == x_xD.shape and a_xD.dtype == x_xD.dtype and _backward_kernel_path(x_xD, weight_D, a_xD):
        return _AddRMSNormFn.apply(x_xD, a_xD, weight_D, eps)
    h_xD = x_xD + a_xD
    return h_xD, rms_norm(h_xD, weight_D, eps)
