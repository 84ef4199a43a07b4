"""Inputs and references for the combine's one rounding (tests only).

The combine adds the weighted expert outputs and the shared experts' output in one fp32
accumulator and rounds once (:func:`dropless.ops.rows.gather_sum`). :func:`near_cancelling`
builds bf16 inputs whose sum is exact in fp32 in any order (every term a multiple of
``2^-15`` below ``2^3``), with an addend that nearly cancels the routed sum, so the
once-rounded result must equal the float64 sum rounded to bf16 bit for bit, while a
routed sum rounded to bf16 before the addend joins it is off by up to hundreds of ulp.
"""

from __future__ import annotations

import torch


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """float64 spacing of bf16 numbers at ``|x|`` (8 significant bits): ``2^(e - 8)`` for ``|x| = m·2^e``,
    ``m`` in ``[0.5, 1)``."""
    _, e = torch.frexp(x.double().abs().clamp_min(2.0 ** -126))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 8)


def bf16_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` (exact in fp32) rounded to bf16 toward zero: how Triton's CPU interpreter casts fp32 to bf16
    (its cast drops the low 16 bits; a GPU rounds to nearest even, as torch does)."""
    bits = x.float().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)


def near_cancelling(n: int, k: int, m: int, h: int, seed: int, weighted: bool = True, addend_rows: int | None = None,
                    addend_row0: int = 0, device: str = "cpu", toward_zero: bool = False):
    """``(rows_MH bf16, dest_Nk, weight_Nk fp32 or None, addend_AH bf16, want_NH bf16)``.

    ``rows`` are ``i·2^-7`` (``|i| <= 128``), weights ``i·2^-8`` (``1 <= i <= 255``), the addend
    ``-(routed sum)·(1 + δ)`` on its rows (δ in ``{0, ±2^-10 … ±2^-3}``) rounded to a multiple of
    ``2^-15`` and to bf16; one choice is dropped (``dest = -1``) and unused rows are NaN.
    ``want`` is the float64 sum (exact) rounded once to bf16: to nearest even, or with
    ``toward_zero`` toward zero (:func:`bf16_toward_zero`).
    """
    g = torch.Generator().manual_seed(seed)
    dest = torch.randperm(m, generator=g)[: n * k].view(n, k)
    dest[n // 2, k - 1] = -1
    rows = torch.randint(-128, 129, (m, h), generator=g).double() * 2.0 ** -7
    used = torch.zeros(m, dtype=torch.bool)
    used[dest[dest >= 0]] = True
    rows[~used] = float("nan")
    w = torch.randint(1, 256, (n, k), generator=g).double() * 2.0 ** -8 if weighted else torch.ones(n, k,
                                                                                                   dtype=torch.float64)
    routed = torch.zeros(n, h, dtype=torch.float64)
    for j in range(k):
        d = dest[:, j]
        c = rows[d.clamp(min=0)] * w[:, j: j + 1]
        routed += torch.where((d >= 0).unsqueeze(1), c, torch.zeros_like(c))
    a_rows = n - addend_row0 if addend_rows is None else addend_rows
    lo, hi = addend_row0, addend_row0 + a_rows
    deltas = torch.tensor([0.0] + [s * 2.0 ** -p for p in range(3, 11) for s in (1, -1)], dtype=torch.float64)
    delta = deltas[torch.randint(0, len(deltas), (a_rows, h), generator=g)]
    addend = (torch.round(-routed[lo:hi] * (1 + delta) * 2.0 ** 15) * 2.0 ** -15).to(torch.bfloat16)
    total = routed.clone()
    total[lo:hi] += addend.double()
    want = bf16_toward_zero(total) if toward_zero else total.to(torch.bfloat16)  # exact in fp32: one rounding
    to = dict(device=device)
    return (rows.to(torch.bfloat16).to(**to), dest.to(**to), w.float().to(**to) if weighted else None,
            addend.to(**to), want.to(**to))
