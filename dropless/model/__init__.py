"""The DeepSeek-V3-shaped decoder: MLA attention, dense and MoE blocks, and its parameter/FLOP totals."""

from dropless.model.attention import MLA, Attention
from dropless.model.norm import RMSNorm
from dropless.model.params import count_parameters
from dropless.model.rope import apply_rope, rope_cos_sin, rope_inv_freq
from dropless.model.transformer import Block, LossOutput, Transformer

__all__ = [
    "Attention", "Block", "LossOutput", "MLA", "RMSNorm", "Transformer",
    "apply_rope", "count_parameters", "rope_cos_sin", "rope_inv_freq",
]
