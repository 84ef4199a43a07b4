"""RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019).

``y = x / sqrt(mean(x^2) + eps) * weight``, computed in at least fp32 and cast
back to the input dtype, as DeepSeek-V3 does for its ``attention_norm``,
``ffn_norm``, the final norm and MLA's ``q_norm`` / ``kv_norm``
(``rms_norm_eps`` of config.json). The forward is ``F.rms_norm``; where the
Triton kernels run, the backward is :func:`dropless.ops.rms_norm.rms_norm_backward`
(the input and weight gradients in one pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dropless.ops import select
from dropless.ops.rms_norm import rms_norm_backward, rms_norm_backward_torch


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


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension.

    Args:
        dim: size of the normalised (last) dimension.
        eps: ``rms_norm_eps``; added to the mean square before the rsqrt.

    Parameters:
        weight: [dim], initialised to ones.

    Shapes: ``x_xD`` [..., dim] -> [..., dim], same dtype as ``x``. The
    computation runs in ``promote_types(x.dtype, float32)`` (fp32 for bf16/fp16
    inputs, fp64 for fp64 inputs), weight included. A 16-bit input with a weight of
    its own dtype goes to ``F.rms_norm`` as it is: its kernels (CUDA fused, CPU
    composite) compute the statistics and the scaling in fp32 and round once, the same
    result as casting up first, but autograd saves the 16-bit input (not an fp32 copy)
    and no cast kernels run.

    Backward: where :func:`dropless.ops.select.use_triton` takes ``x`` (CUDA), ``x`` is
    bf16/fp16/fp32 and the weight ``x``'s dtype or fp32, in eager autograd (not while
    ``torch.compile`` traces, not under ``torch.func`` transforms), the forward above runs
    inside an autograd Function that saves only ``x`` and the weight, and its backward is
    :func:`dropless.ops.rms_norm.rms_norm_backward`: ``dx`` and ``dweight`` in one Triton
    kernel (the same formula in fp32; last-bit differences from torch's backward). Everywhere
    else, autograd differentiates ``F.rms_norm``.

    Raises:
        ValueError: ``dim`` not positive.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        if int(dim) <= 0:
            raise ValueError(f"RMSNorm(dim={dim}): dim must be positive")
        self.dim = int(dim)
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(self.dim))

    def forward(self, x_xD: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (torch.is_grad_enabled() and x_xD.dtype in (torch.bfloat16, torch.float16, torch.float32)
                and w.dtype in (x_xD.dtype, torch.float32) and select.use_triton(x_xD)
                and not torch.compiler.is_compiling()
                and not any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in (x_xD, w))):
            return _RMSNormFn.apply(x_xD, w, self.eps)
        return _rms_norm(x_xD, w, self.eps)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Weight back to ones (the identity scale)."""
        self.weight.fill_(1.0)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"
