"""RoPE on the last R features of each head, the head's first D − R copied, into one new tensor (MLA).

For ``x_BSND`` and rotation tables ``cos_SP`` / ``sin_SP`` (P = R / 2 interleaved pairs, the
convention of :mod:`dropless.model.rope`), :func:`rotate_tail` returns a contiguous ``[B, S, N, D]``
tensor in ``x``'s dtype::

    out[..., :D−R]          = x[..., :D−R]
    out[..., D−R+2i]        = a·cos − b·(σ·sin)          (a, b) = x[..., D−R+2i], x[..., D−R+2i+1]
    out[..., D−R+2i+1]      = b·cos + a·(σ·sin)          σ = ``sign`` (+1: rotate; −1: the transpose)

computed in ``promote_types(x.dtype, cos.dtype, float32)`` and rounded once. σ = −1 is the
backward of σ = +1 (a rotation's transpose is the rotation by the negative angle).

Three implementations, picked here and nowhere else:

* **Triton** (``x`` on CUDA, eager, no autograd graph being recorded, no ``torch.func`` transform):
  one kernel that reads each element of ``x`` once and writes each output element once; ``x`` may
  have any strides over (B, S, N) (the gradient SDPA returns is ``[B, N, S, D]`` in memory), its
  last dim contiguous.
* **The functional expression** (compiling, grad mode on — a backward with ``create_graph=True`` —,
  or under ``torch.func``): ``x·[c, c] + swap(x)·[−σs, σs]`` as one differentiable expression and
  a ``cat`` with the head, which inductor fuses into one kernel (writes into the two halves of each
  pair would become two passes after functionalisation; ``addcmul(out=)`` is not differentiable;
  ``vmap`` cannot write a batched value into a preallocated output; a Triton launch is opaque to
  autograd and ``torch.func``).
* **The eager torch path** (CPU, no grad mode): the head's copy, then ``x·[c, c]``, the swap and
  ``addcmul`` stored into the output.

Any of them may contract a product and a sum into one fused multiply-add (a last-bit difference in
the compute dtype).

Shape letters: B batch, S positions, N heads, D features per head, R = 2·P rotated features.
"""

from __future__ import annotations

import torch

from dropless.ops import select

__all__ = ["rotate_tail"]

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_tail_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, S, N, sx_b, sx_s, sx_n, sign,
                          HEAD: tl.constexpr, P: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                          BLOCK_HEAD: tl.constexpr, BLOCK_P: tl.constexpr, F64: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = rows < n_rows
        rows = tl.where(live, rows, 0).to(tl.int64)
        n = rows % N
        s = (rows // N) % S
        b = rows // (N * S)
        src = x_ptr + b * sx_b + s * sx_s + n * sx_n                  # [BLOCK_ROWS] row starts
        dst = out_ptr + rows * (HEAD + 2 * P)                          # the output is contiguous
        if HEAD > 0:
            h = tl.arange(0, BLOCK_HEAD)
            hm = live[:, None] & (h[None, :] < HEAD)
            tl.store(dst[:, None] + h[None, :], tl.load(src[:, None] + h[None, :], mask=hm), mask=hm)
        # the tail as whole rows [BLOCK_ROWS, 2·BLOCK_P], split into the pairs' two members
        t = tl.arange(0, 2 * BLOCK_P)
        tm = live[:, None] & (t[None, :] < 2 * P)
        xt = tl.load(src[:, None] + HEAD + t[None, :], mask=tm, other=0.0)
        xt = xt.to(tl.float64) if F64 else xt.to(tl.float32)
        a, bb = tl.split(tl.reshape(xt, (BLOCK_ROWS, BLOCK_P, 2)))
        p = tl.arange(0, BLOCK_P)
        pm = live[:, None] & (p[None, :] < P)
        c = tl.load(cos_ptr + s[:, None] * P + p[None, :], mask=pm, other=0.0)
        sn = tl.load(sin_ptr + s[:, None] * P + p[None, :], mask=pm, other=0.0)
        c = c.to(tl.float64) if F64 else c.to(tl.float32)
        sn = (sn.to(tl.float64) if F64 else sn.to(tl.float32)) * sign
        out = tl.reshape(tl.join(a * c - bb * sn, bb * c + a * sn), (BLOCK_ROWS, 2 * BLOCK_P))
        tl.store(dst[:, None] + HEAD + t[None, :], out.to(out_ptr.dtype.element_ty), mask=tm)


def _rotate_tail_triton(x_BSND: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor,
                        sign: float) -> torch.Tensor:
    B, S, N, D = x_BSND.shape
    P = cos_SP.shape[1]
    if x_BSND.stride(-1) != 1:
        x_BSND = x_BSND.contiguous()
    cos_SP, sin_SP = cos_SP.contiguous(), sin_SP.contiguous()
    out = torch.empty((B, S, N, D), dtype=x_BSND.dtype, device=x_BSND.device)
    n_rows = B * S * N
    if n_rows == 0 or P == 0:                                      # nothing to rotate: the copy alone
        return out.copy_(x_BSND)
    block_d = triton.next_power_of_2(D)
    block_rows = max(1, min(32, 4096 // block_d))                  # about 4k elements a program
    f64 = torch.float64 in (x_BSND.dtype, cos_SP.dtype, sin_SP.dtype)
    grid = (triton.cdiv(n_rows, block_rows),)
    _rope_tail_kernel[grid](x_BSND, cos_SP, sin_SP, out, n_rows, S, N, x_BSND.stride(0), x_BSND.stride(1),
                            x_BSND.stride(2), float(sign), HEAD=D - 2 * P, P=P, BLOCK_ROWS=block_rows,
                            BLOCK_HEAD=triton.next_power_of_2(max(D - 2 * P, 1)),
                            BLOCK_P=triton.next_power_of_2(P), F64=f64, num_warps=4)
    return out


def _rotate_tail_torch(x_BSND: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor, sign: float,
                       functional: bool) -> torch.Tensor:
    """The two torch paths of the module docstring (``functional``: the one-expression form)."""
    S, P = cos_SP.shape
    n = x_BSND.shape[-1] - 2 * P
    compute = torch.promote_types(torch.promote_types(x_BSND.dtype, cos_SP.dtype), torch.float32)
    c = cos_SP.to(compute)
    s = sin_SP.to(compute)
    cc_1S1R = torch.stack((c, c), dim=-1).flatten(-2)[None, :, None, :]
    ss_1S1R = torch.stack((-s, s), dim=-1).flatten(-2)[None, :, None, :]
    x_xR = x_BSND[..., n:]
    swapped_xR = x_xR.unflatten(-1, (P, 2)).flip(-1).flatten(-2)  # (b, a) per pair
    if functional:
        x_cR = x_xR.to(compute)
        if n == 0 and not x_cR.is_contiguous():  # the sum below takes its layout: contiguous output
            x_cR = x_cR.contiguous()
        rot_xR = x_cR * cc_1S1R + swapped_xR.to(compute) * (sign * ss_1S1R)
        if n:
            return torch.cat((x_BSND[..., :n], rot_xR.to(x_BSND.dtype)), dim=-1)
        # The sum itself, or its real conversion: never a no-op (``.to`` of its own dtype,
        # ``.contiguous()`` of a contiguous tensor) that returns its input, which torch 2.11's
        # Dynamo turns into a zero gradient for the Function's backward (_RopeTail of the rope key).
        return rot_xR if rot_xR.dtype == x_BSND.dtype else rot_xR.to(x_BSND.dtype)
    out = torch.empty(x_BSND.shape, dtype=x_BSND.dtype, device=x_BSND.device)
    if n:
        out[..., :n].copy_(x_BSND[..., :n])
    torch.addcmul(x_xR * cc_1S1R, swapped_xR, ss_1S1R, value=sign, out=out[..., n:])
    return out


def rotate_tail(x_BSND: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor, sign: float) -> torch.Tensor:
    """``[x[..., :D−R] | rotate(x[..., D−R:], sign·angle)]`` as a new contiguous tensor (module docstring).

    Args:
        x_BSND: [B, S, N, D], D ≥ 2·P.
        cos_SP, sin_SP: [S, P] rotation tables (:func:`dropless.model.rope.rope_cos_sin`).
        sign: +1.0 (forward) or −1.0 (the transpose, for backward).
    Returns:
        [B, S, N, D] contiguous, in ``x``'s dtype.
    Shapes are checked by the caller (:func:`dropless.model.rope.rope_tail`).
    """
    functional = (torch.compiler.is_compiling() or torch.is_grad_enabled()
                  or any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in (x_BSND, cos_SP, sin_SP)))
    if not functional and select.use_triton(x_BSND):
        return _rotate_tail_triton(x_BSND, cos_SP, sin_SP, sign)
    return _rotate_tail_torch(x_BSND, cos_SP, sin_SP, sign, functional)
