"""The DeepSeek-V3-shaped decoder: MLA attention, dense and MoE blocks.

``dropless.moe`` is imported lazily (inside :class:`Block`), because it imports
:mod:`dropless.model.mlp` for the shared experts.
"""

from dropless.model.attention import MLA, Attention
from dropless.model.mlp import FeedForward
from dropless.model.norm import RMSNorm
from dropless.model.params import count_parameters
from dropless.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from dropless.model.transformer import Block, LossOutput, Transformer

__all__ = [
    "Attention", "Block", "FeedForward", "LossOutput", "MLA", "RMSNorm", "Transformer",
    "apply_rope", "count_parameters", "rope_cos_sin", "rope_inv_freq",
]
