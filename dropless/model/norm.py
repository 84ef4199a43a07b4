"""RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019).

``y = x / sqrt(mean(x^2) + eps) * weight``, computed in at least fp32 and cast
back to the input dtype, as DeepSeek-V3 does for its ``attention_norm``,
``ffn_norm``, the final norm and MLA's ``q_norm`` / ``kv_norm``
(``rms_norm_eps`` of config.json), through :func:`dropless.ops.rms_norm.rms_norm`
(``F.rms_norm`` forward; where the Triton kernels run, the input and weight gradients
in one pass).
"""

from __future__ import annotations

import torch
from torch import nn

from dropless.ops.rms_norm import add_rms_norm, rms_norm


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

    Backward: on CUDA in eager autograd, ``dx`` and ``dweight`` in one Triton kernel that
    saves only ``x`` and the weight (:func:`dropless.ops.rms_norm.rms_norm` says where);
    elsewhere autograd through ``F.rms_norm``.

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
        return rms_norm(x_xD, self.weight, self.eps)

    def forward_add(self, x_xD: torch.Tensor, a_xD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add and this norm: ``(h, self(h))`` with ``h = x + a`` (``x``, ``a`` of one shape
        and dtype), in one kernel forward and one backward where the Triton kernels run
        (:func:`dropless.ops.rms_norm.add_rms_norm`), else the two plain ops. Call it from inside the
        module that owns this norm (FSDP2 gathers the weight for that module's forward)."""
        return add_rms_norm(x_xD, a_xD, self.weight, self.eps)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Weight back to ones (the identity scale)."""
        self.weight.fill_(1.0)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"
