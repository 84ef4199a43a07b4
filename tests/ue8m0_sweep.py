"""The amax sweep and the checks of power-of-two (UE8M0) FP8 scales (tests only).

The rule: ``scale = 2^ceil(log2(s))`` of the fp32 ``s = amax / 448``, the ceiling read from
``s``'s bits as DeepGEMM's ``fast_log2_ceil`` does (biased exponent, plus one when a mantissa
bit is set). The sweep puts ``amax`` exactly at, one fp32 step below and one above
``448·2^k`` for many ``k``: fp32 ``log2`` of ``2^k·(1 + 2^-23)`` rounds down to ``k``, so
``exp2(ceil(log2(s)))`` gives a scale one step too small there.
"""

from __future__ import annotations

import torch

from dropless.layout import ExpertLayout
from dropless.ops import swiglu as sw
from dropless.ops.fp8_quant import (
    quant_expert_columns,
    quant_rows,
    quant_token_blocks,
    quant_weight,
    quant_weight_blocks,
    swiglu_quant_rows,
)

FP8_MAX = 448.0


def amax_sweep(k_lo: int, k_hi: int, step: int = 1) -> torch.Tensor:
    """fp32 amax values ``[prev(448·2^k), 448·2^k, next(448·2^k)]`` for ``k`` in ``range(k_lo, k_hi, step)``."""
    at = torch.tensor([FP8_MAX * 2.0 ** k for k in range(k_lo, k_hi, step)], dtype=torch.float32)
    below = torch.nextafter(at, torch.zeros_like(at))
    above = torch.nextafter(at, torch.full_like(at, float("inf")))
    return torch.stack([below, at, above], 1).reshape(-1)


def deep_gemm_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^(biased_exp(s) - 127 + (mantissa(s) != 0))`` of ``s = fl32(amax / 448)`` (normal ``s``)."""
    bits = (amax.float() / FP8_MAX).view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (e << 23).view(torch.float32)


def check_scales(amax: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """Each power-of-two ``scale`` against its unit's fp32 ``amax`` (same shape).

    ``amax / scale <= 448`` (no element clipped), ``amax / (scale / 2) > 448`` (the smallest such
    power of two), DeepGEMM's scale bit for bit, and ``2^k`` exactly at ``amax = 448·2^k``.
    """
    a, s = amax.double().cpu().reshape(-1), scale.double().cpu().reshape(-1)
    m, _ = torch.frexp(s)
    assert (m == 0.5).all(), f"{what}: a scale is not a power of two"
    over = a / s > FP8_MAX
    assert not over.any(), f"{what}: amax / scale > 448 (the largest element clipped) at amax = {a[over][:4].tolist()}"
    loose = a / (s / 2) <= FP8_MAX
    assert not loose.any(), f"{what}: scale / 2 would do at amax = {a[loose][:4].tolist()}"
    assert torch.equal(scale.float().cpu().reshape(-1), deep_gemm_scale(amax.cpu().reshape(-1))), what
    exact = torch.frexp(a / FP8_MAX)[0] == 0.5
    assert torch.equal(s[exact], a[exact] / FP8_MAX), what


# ----------------------------------------------------------------------------- every quantiser on the sweep
# Each ``case_*`` takes fp32 amax values ``[L]`` and a device, builds an input whose scale units
# (rows, 1x128 groups, 128-row column blocks, expert columns, weight channels, 128x128 blocks)
# have those amax values (one element at ±amax, a quarter of it elsewhere), runs the quantiser
# with ``ue8m0=True`` and returns ``(scale, amax)`` of the same shape. The op picks its Triton or
# torch path as usual (tests force the Triton path under the interpreter).

def _rows(amax: torch.Tensor, width: int) -> torch.Tensor:
    """``[L, width]``: row ``i`` holds ``±amax[i]`` at column ``i % width`` and ``amax[i] / 4`` elsewhere."""
    n = amax.numel()
    x = (amax / 4).unsqueeze(1).repeat(1, width)
    sign = 1 - 2 * (torch.arange(n) % 2).float()
    x[torch.arange(n), torch.arange(n) % width] = amax * sign
    return x


def _layout(counts: list[int], device) -> ExpertLayout:
    return ExpertLayout.from_counts(torch.tensor(counts, device=device), 128, capacity=sum(counts))


def case_quant_rows(amax, device, group=0):
    _, s = quant_rows(_rows(amax, 128 if group else 48).to(device), None, ue8m0=True, group=group)
    return s.reshape(-1), amax


def case_swiglu_quant_rows(amax, device, group=0):
    """gate = 64 (silu(64) = 64 exactly in fp32) and up = x / 64, so silu(gate) · up = x exactly."""
    x = _rows(amax, 128 if group else 48)
    h13 = torch.cat([torch.full_like(x, 64.0), x / 64], 1).to(device)
    _, s = swiglu_quant_rows(h13, None, ue8m0=True, group=group)
    return s.reshape(-1), amax


def case_swiglu_quant(amax, device):
    """:func:`dropless.ops.swiglu.swiglu_quant` (its own kernel; 1x128 groups, amax floor 1e-10)."""
    x = _rows(amax, 128)
    h13 = torch.cat([torch.full_like(x, 64.0), x / 64], 1).to(device)
    _, s = sw.swiglu_quant(h13, _layout([x.shape[0]], device), ue8m0=True)
    return s.reshape(-1), amax


def _column_blocks(amax: torch.Tensor, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [128·n_blocks, K]`` whose (128-row block b, column c) unit holds ``amax[b·K + c]`` (padded by
    repeating the sweep), with the amax grid ``[n_blocks, K]``."""
    k = -(-amax.numel() // n_blocks)
    grid = amax.repeat(2)[: n_blocks * k].view(n_blocks, k)
    x = (grid / 4).repeat_interleave(128, 0)
    rows = torch.arange(n_blocks).unsqueeze(1) * 128 + (torch.arange(k) % 128)
    x[rows, torch.arange(k).expand(n_blocks, k)] = -grid
    return x, grid


def case_quant_token_blocks(amax, device):
    x, grid = _column_blocks(amax, 3)
    _, s = quant_token_blocks(x.to(device), _layout([x.shape[0]], device), ue8m0=True)
    return s, grid


def case_quant_expert_columns(amax, device):
    x, grid = _column_blocks(amax, 3)  # three experts of 128 rows: one 128-row block each
    _, s = quant_expert_columns(x.to(device), _layout([128, 128, 128], device), ue8m0=True)
    return s, grid


def case_quant_weight(amax, device, contract_dim=1):
    """w ``[e = 2, K = 40, N]``: output channel n of expert i (a column of w[i] for contract_dim 1, a row for
    2) holds ``amax[i·N + n]``."""
    x = _rows(amax.repeat(2)[: 2 * (-(-amax.numel() // 2))], 40)  # [2N, K]: one channel per row
    w_NK = x.view(2, -1, 40)
    w = (w_NK.transpose(1, 2).contiguous() if contract_dim == 1 else w_NK.contiguous()).to(device)
    _, s = quant_weight(w, contract_dim, ue8m0=True)
    return s.reshape(-1), amax.repeat(2)[: s.numel()]


def case_quant_weight_blocks(amax, device):
    """w_NK ``[1, 128·nb, 128]``: each 128x128 block one amax (the torch path only)."""
    nb = amax.numel()
    x = (amax / 4).repeat_interleave(128).unsqueeze(1).repeat(1, 128)
    x[torch.arange(nb) * 128 + torch.arange(nb) % 128, torch.arange(nb) % 128] = amax
    _, s = quant_weight_blocks(x.view(1, nb * 128, 128).to(device), contract_dim=2, ue8m0=True)
    return s.reshape(-1), amax
