"""SwiGLU feed-forward network, shared by the dense decoder layers and the MoE's shared experts.

``FeedForward(dim, hidden_dim)(x) = w2( silu(w1 x) * w3 x )`` — the gated
linear unit with a SiLU gate of Shazeer, "GLU Variants Improve Transformer"
(2020), as used by DeepSeek-V3 for its dense layers (``intermediate_size``)
and its shared experts (``n_shared_experts * moe_intermediate_size``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """Dense SwiGLU MLP without biases.

    Args:
        dim: model width H (``hidden_size``).
        hidden_dim: inner width (``intermediate_size`` for a dense layer,
            ``n_shared_experts * moe_intermediate_size`` for the shared experts).

    Parameters:
        w1: gate projection, ``nn.Linear(dim, hidden_dim)``, weight [hidden_dim, dim].
        w3: up projection, ``nn.Linear(dim, hidden_dim)``, weight [hidden_dim, dim].
        w2: down projection, ``nn.Linear(hidden_dim, dim)``, weight [dim, hidden_dim].

    Raises:
        ValueError: if ``dim`` or ``hidden_dim`` is not a positive integer.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        if int(dim) <= 0 or int(hidden_dim) <= 0:
            raise ValueError(
                f"FeedForward(dim={dim}, hidden_dim={hidden_dim}): both must be positive "
                "(hidden_dim comes from intermediate_size, or n_shared_experts*moe_intermediate_size)"
            )
        self.dim = int(dim)
        self.hidden_dim = int(hidden_dim)
        self.w1 = nn.Linear(self.dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.dim, self.hidden_dim, bias=False)
        self.w2 = nn.Linear(self.hidden_dim, self.dim, bias=False)

    def forward(self, x_xH: torch.Tensor) -> torch.Tensor:
        """``x_xH`` [..., H] -> [..., H], same dtype as the weights' compute."""
        return self.w2(F.silu(self.w1(x_xH)) * self.w3(x_xH))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}"
