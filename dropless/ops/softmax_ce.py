"""Cross-entropy of one chunk of logits and its gradient, in place, in one kernel (the LM head's loss).

For logits ``z_CV`` (C rows of a chunk, V classes), targets ``t_C`` and row weights ``w_C``
(``1/n`` for a mean, 0 on ignored rows), :func:`softmax_ce_grad_` returns the per-row loss

    ``loss_C[c] = logsumexp(z[c]) − z[c, t[c]]``            (fp32, unweighted)

and, with ``grad=True``, overwrites ``z`` with ``w[c] · (softmax(z[c]) − onehot(t[c]))`` in ``z``'s
dtype: the gradient of ``Σ_c w[c]·loss[c]`` wrt the logits. Both are computed in fp32 from the
stored logits (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", for the
one-pass max / sum). The Triton kernel reads the chunk twice and writes it once; the torch
reference (CPU, float64) holds fp32 temporaries of the chunk. :func:`dropless.ops.select.use_triton`
picks.

Shape letters: C rows of the chunk, V vocabulary.
"""

from __future__ import annotations

import torch

from dropless.ops import select

__all__ = ["softmax_ce_grad_", "softmax_ce_grad_torch_"]

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _softmax_ce_kernel(z_ptr, tgt_ptr, w_ptr, loss_ptr, stride_z, V: tl.constexpr, GRAD: tl.constexpr,
                           BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        base = z_ptr + row.to(tl.int64) * stride_z
        cols0 = tl.arange(0, BLOCK_V)
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)   # per-lane running max and sum of exp
        s = tl.zeros([BLOCK_V], dtype=tl.float32)
        for off in tl.range(0, V, BLOCK_V):
            cols = off + cols0
            z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, z)
            s = s * tl.exp(tl.where(m == m_new, 0.0, m - m_new)) + tl.where(z == float("-inf"), 0.0, tl.exp(z - m_new))
            m = m_new
        mx = tl.max(m, 0)
        tot = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - mx)), 0)
        lse = mx + tl.log(tot)
        t = tl.load(tgt_ptr + row)
        zt = tl.load(base + t).to(tl.float32)
        tl.store(loss_ptr + row, lse - zt)
        if GRAD:
            w = tl.load(w_ptr + row).to(tl.float32)
            for off in tl.range(0, V, BLOCK_V):
                cols = off + cols0
                cmask = cols < V
                z = tl.load(base + cols, mask=cmask, other=0.0).to(tl.float32)
                g = (tl.exp(z - lse) - tl.where(cols == t, 1.0, 0.0)) * w
                tl.store(base + cols, g.to(z_ptr.dtype.element_ty), mask=cmask)


def softmax_ce_grad_torch_(z_CV: torch.Tensor, tgt_C: torch.Tensor, w_C: torch.Tensor, grad: bool) -> torch.Tensor:
    """Reference of :func:`softmax_ce_grad_` (fp32 temporaries; float64 for float64 logits)."""
    acc = torch.promote_types(z_CV.dtype, torch.float32)
    z = z_CV.to(acc)
    lse_C = torch.logsumexp(z, dim=1)
    loss_C = lse_C - z.gather(1, tgt_C.unsqueeze(1)).squeeze(1)
    if grad:  # z is z_CV itself for fp32 logits: overwritten either way
        g = z.sub_(lse_C.unsqueeze(1)).exp_()
        g.scatter_add_(1, tgt_C.unsqueeze(1), torch.full_like(loss_C, -1.0).unsqueeze(1))
        g.mul_(w_C.to(acc).unsqueeze(1))
        if g is not z_CV:
            z_CV.copy_(g)
    return loss_C


def softmax_ce_grad_(z_CV: torch.Tensor, tgt_C: torch.Tensor, w_C: torch.Tensor, grad: bool = True) -> torch.Tensor:
    """Per-row cross-entropy of ``z_CV``; with ``grad``, ``z_CV`` becomes its weighted gradient (in place).

    Args:
        z_CV: ``[C, V]`` logits (bf16, fp16, fp32; float64 on the torch path), rows contiguous.
        tgt_C: int64 ``[C]`` target ids in ``[0, V)`` (ignored rows: any valid id, with weight 0).
        w_C: ``[C]`` row weights (fp32): the gradient of row ``c`` is scaled by ``w_C[c]``.
        grad: overwrite ``z_CV`` with ``w · (softmax(z) − onehot(t))`` (else ``z_CV`` is left as is).
    Returns:
        ``loss_C`` ``[C]``, fp32 (float64 for float64 logits), not weighted.
    Raises:
        ValueError: shapes that do not match, or strided columns.
    """
    if z_CV.dim() != 2 or tgt_C.shape != (z_CV.shape[0],) or w_C.shape != (z_CV.shape[0],):
        raise ValueError(f"softmax_ce_grad_: logits must be [C, V] with targets and weights [C]; got "
                         f"{tuple(z_CV.shape)}, {tuple(tgt_C.shape)}, {tuple(w_C.shape)}")
    kernel = select.use_triton(z_CV) and z_CV.dtype != torch.float64
    if not kernel:
        return softmax_ce_grad_torch_(z_CV, tgt_C, w_C, grad)
    if z_CV.stride(1) != 1:
        raise ValueError(f"softmax_ce_grad_: the logits' columns must be contiguous, got strides {z_CV.stride()}")
    c, v = z_CV.shape
    loss_C = torch.empty(c, dtype=torch.float32, device=z_CV.device)
    if c == 0:
        return loss_C
    _softmax_ce_kernel[(c,)](z_CV, tgt_C.contiguous(), w_C.contiguous(), loss_C, z_CV.stride(0), V=v, GRAD=bool(grad),
                             BLOCK_V=min(4096, triton.next_power_of_2(v)), num_warps=8)
    return loss_C
