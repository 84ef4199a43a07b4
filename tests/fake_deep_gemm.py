"""A CPU stand-in for the two functions of DeepGEMM's Python API that ``gemm=deep_gemm`` calls (tests only).

It follows DeepGEMM's calling convention and host-side checks as read from its sources
(``csrc/apis/gemm.hpp``, 2026-06 tree): ``m_grouped_fp8_gemm_nt_contiguous(a, b, d,
grouped_layout, ..., disable_ue8m0_cast, use_psum_layout, ...)`` with ``a = (e4m3 [M, K]
K-major, fp32 scales [M, K/128])``, ``b = (e4m3 [G, N, K] K-major, fp32 scales [G, N/128,
K/128])``, ``d`` bf16 ``[M, N]`` written in place, and with ``use_psum_layout`` an int32 ``[G]``
of group ends: group ``g``'s rows are ``[align(end[g-1], 128), end[g])``. It computes the
live rows as dequantised fp32 products and fills every other row of ``d`` with NaN, so a
caller that reads a row DeepGEMM does not promise fails the tests. What it cannot stand for:
the kernel's accumulation order, its speed, its JIT.
"""

from __future__ import annotations

import torch

ALIGNMENT = 128
calls: list[dict] = []  # one record per GEMM call (tests)


def get_mk_alignment_for_contiguous_layout() -> int:
    return ALIGNMENT


def _dequant_a(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    m, k = q.shape
    return (q.float().view(m, k // 128, 128) * s.unsqueeze(-1)).view(m, k)


def _dequant_b(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.float().view(n // 128, 128, k // 128, 128) * s[:, None, :, None]).view(n, k)


def m_grouped_fp8_gemm_nt_contiguous(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                                     compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                                     ensure_zero_padding=True, expected_m_for_psum_layout=None) -> None:
    (aq, asf), (bq, bsf) = a, b
    m, k = aq.shape
    g, n, k2 = bq.shape
    assert aq.dtype == bq.dtype == torch.float8_e4m3fn, (aq.dtype, bq.dtype)
    assert aq.stride(1) == 1 and bq.stride(2) == 1, "DeepGEMM takes K-major FP8 operands"
    assert k == k2 and d.shape == (m, n) and d.dtype == torch.bfloat16 and d.stride(1) == 1
    assert asf.dtype == bsf.dtype == torch.float32
    assert asf.shape == (m, k // 128) and bsf.shape == (g, n // 128, k // 128), (asf.shape, bsf.shape)
    assert grouped_layout.dtype == torch.int32 and grouped_layout.is_contiguous()
    assert use_psum_layout and grouped_layout.shape == (g,), "dropless calls the psum layout"
    calls.append(dict(m=m, n=n, k=k, groups=g, disable_ue8m0_cast=disable_ue8m0_cast))
    d.fill_(float("nan"))
    start = 0
    for i, end in enumerate(grouped_layout.tolist()):
        assert start <= end <= m, (start, end, m)
        if end > start:
            rows = _dequant_a(aq[start:end], asf[start:end])
            d[start:end] = (rows @ _dequant_b(bq[i], bsf[i]).t()).to(d.dtype)
        start = -(-end // ALIGNMENT) * ALIGNMENT
