"""Power-of-two (UE8M0) FP8 scales: ``2^ceil(log2(s))`` of an fp32 scale ``s = amax / 448``, exactly.

The ceiling is read from the fp32 bits of ``s`` (``s = m·2^e``, ``m`` in ``[1, 2)``: the result is
``2^e`` when ``m = 1``, else ``2^(e+1)``), as DeepGEMM's ``fast_log2_ceil`` does (biased exponent
plus one when any mantissa bit is set), so the scales are bit-identical to DeepGEMM's UE8M0
scales. ``exp2(ceil(log2(s)))`` in fp32 is not: fp32 ``log2`` of ``2^k·(1 + 2^-23)`` rounds to
``k`` for many ``k``, the scale comes out ``2^k``, ``amax / scale`` exceeds 448 and the largest
element is clipped.

* :func:`pow2_ceil` — the torch form (``torch.frexp`` / ``torch.ldexp``), for the torch references.
* :func:`pow2_ceil_bits` — the Triton ``@triton.jit`` form (integer operations on the fp32 bits),
  called inside the quantising kernels (:mod:`dropless.ops.fp8_quant`, :mod:`dropless.ops.swiglu`).

Both take positive fp32 scales (the quantisers floor ``amax`` first); a subnormal ``s`` gets its
exact power-of-two ceiling too, and ``inf`` / NaN pass through unchanged.

* :func:`amax_scale` — ``s = max(amax, eps) / 448`` itself, the torch form. The quotient is the
  IEEE round-to-nearest one on every device, as the kernels' ``tl.math.div_rn(amax, 448.0)``
  (Triton's ``/`` on fp32 may lower to an approximate division on the GPU). A Python-number
  divisor would not do: on CUDA, torch divides by a host scalar by multiplying with its fp32
  reciprocal, which for some ``amax`` is one ulp off the quotient (then the scales, the codes and
  the power-of-two ceilings of the torch references and the kernels differ), so the divisor is a
  tensor on ``amax``'s device.
"""

from __future__ import annotations

import torch

from dropless.ops import select

FP8_MAX = 448.0  # largest finite float8_e4m3fn

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def pow2_ceil_bits(s):
        """fp32 ``s > 0`` -> ``2^ceil(log2(s))`` (fp32), from the bits of ``s``; ``inf`` / NaN unchanged."""
        bits = s.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        up = tl.where((bits & 0x7FFFFF) != 0, 1, 0)
        # a subnormal (biased 0) rounds up to 2^-126 (biased 1); 2^128 overflows to inf's bits
        p = ((biased + up) << 23).to(tl.float32, bitcast=True)
        return tl.where(biased == 0xFF, s, p)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(s))`` of positive fp32 scales, exactly (``s``'s dtype and shape); ``inf`` / NaN unchanged.

    ``torch.frexp`` gives ``s = m·2^e`` with ``m`` in ``[0.5, 1)``: the ceiling is ``2^(e-1)`` when
    ``m = 0.5`` (``s`` a power of two), else ``2^e``.
    """
    m, e = torch.frexp(s)
    p = torch.ldexp(torch.ones_like(s), e - (m == 0.5).to(e.dtype))
    return torch.where(torch.isfinite(s), p, s)


def amax_scale(amax: torch.Tensor, eps: float) -> torch.Tensor:
    """``max(amax, eps) / 448`` in ``amax``'s dtype, the round-to-nearest quotient on CPU and CUDA alike.

    Args:
        amax: per-row (or per-block) absolute maxima, fp32, any shape and device.
        eps: the floor of ``amax`` (an all-zero row still gets a finite, positive scale).
    """
    return amax.clamp_min(eps) / amax.new_full((), FP8_MAX)
