"""FP8 block-scaled weights, as the released DeepSeek-V3 files store them.

A quantised linear weight ``W`` [out, in] is stored as ``weight`` (``float8_e4m3fn``, same
shape) and ``weight_scale_inv`` (fp32, ``[ceil(out/bo), ceil(in/bi)]``, one scale per
``bo × bi`` block, ``weight_block_size`` = 128 × 128 in ``quantization_config``). The real
weight is ``W[r, c] = weight[r, c] · weight_scale_inv[r // bo, c // bi]`` (the scale is the
inverse of the quantiser's: it multiplies, as DeepSeek's ``weight_dequant`` does). The last
row and column blocks may be partial.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SCALE_SUFFIX", "dequantize_fp8_blocks"]

#: Name suffix of the scale that goes with ``<name>`` = ``....weight``: ``<name>_scale_inv``.
SCALE_SUFFIX = "_scale_inv"


def dequantize_fp8_blocks(w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                          dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """``w_q · scale_inv`` per block, in ``dtype``.

    Args:
        w_q: [out, in] FP8 (or any float) weight.
        scale_inv: [ceil(out/bo), ceil(in/bi)] scales.
        block: ``(bo, bi)``.
        dtype: result dtype (the product is formed in fp32; an fp64 result is formed in fp64).
        name: the tensor's name, for the error message.
    Returns: [out, in] in ``dtype``.
    Raises:
        ValueError: ``w_q`` is not 2-D, or the scale grid does not match its shape and block.
    """
    if w_q.dim() != 2:
        raise ValueError(f"{name}: an FP8 block-scaled weight must be 2-D, got shape {tuple(w_q.shape)}")
    out, inn = w_q.shape
    bo, bi = int(block[0]), int(block[1])
    want = (math.ceil(out / bo), math.ceil(inn / bi))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}{SCALE_SUFFIX}: shape {tuple(scale_inv.shape)} does not match weight shape "
                         f"{(out, inn)} in {bo}x{bi} blocks (expected {want})")
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    s = scale_inv.to(acc)
    if out % bo == 0 and inn % bi == 0:
        w = w_q.to(acc).view(want[0], bo, want[1], bi) * s[:, None, :, None]
        return w.view(out, inn).to(dtype)
    s_full = s.repeat_interleave(bo, dim=0)[:out].repeat_interleave(bi, dim=1)[:, :inn]
    return (w_q.to(acc) * s_full).to(dtype)
