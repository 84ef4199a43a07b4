"""The ops' torch references and their bad-input errors (CPU; issue 13).

The Triton kernels themselves are tested in tests/test_triton_kernels.py (CUDA, or Triton's
interpreter) against the same references.
"""

from __future__ import annotations

import pytest
import torch

from dropless.layout import ExpertLayout
from dropless.ops import rows as rw
from dropless.ops import swiglu as sw


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -6)))
    return torch.exp2(e - 3)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_quant_reference_round_trips_within_half_an_e4m3_step(ue8m0):
    torch.manual_seed(0)
    a = torch.randn(33, 384, dtype=torch.float64) * torch.logspace(-3, 3, 33, dtype=torch.float64).unsqueeze(1)
    a[5, :128] = 0.0  # an all-zero group: scale 1e-10/448, q = 0
    q, s = sw.quant_fp8_torch(a, ue8m0)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (33, 3) and s.dtype == torch.float32
    s_full = s.double().repeat_interleave(128, 1)
    deq = q.double() * s_full
    # round to nearest: at most half a step of the scaled value (scales are rounded to fp32 first)
    assert ((deq - a).abs() <= 0.5 * e4m3_step(a / s_full) * s_full * (1 + 1e-6)).all()
    amax = a.abs().view(33, 3, 128).amax(-1)
    assert (q.float().abs().view(33, 3, 128).amax(-1)[amax > 0] <= 448).all()
    if ue8m0:
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)
        assert (s.double() >= amax / 448).all() and (s.double() < 2 * amax.clamp_min(1e-10) / 448 * (1 + 1e-6)).all()
    else:
        assert torch.allclose(s.double(), amax.clamp_min(1e-10) / 448, rtol=1e-6)
    assert (q[5, :128].float() == 0).all()


def test_swiglu_quant_torch_path_layout_and_strides():
    torch.manual_seed(1)
    lay = ExpertLayout.from_counts(torch.tensor([5, 0, 9]), 8, capacity=30)
    h13 = torch.randn(30, 512)
    q, s = sw.swiglu_quant(h13, lay)
    assert q.shape == (30, 256) and s.shape == (30, 2) and s.stride() == (1, 32)  # MN-major, M rounded up to 4
    qr, sr = sw.quant_fp8_torch(sw.swiglu_fwd_torch(h13), False)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


def test_bad_inputs_are_clear_errors_before_launch():
    lay = ExpertLayout.from_counts(torch.tensor([5, 0, 9]), 8, capacity=30)
    with pytest.raises(ValueError, match="capacity M is 30"):
        sw.swiglu_fwd(torch.randn(31, 16), lay)
    with pytest.raises(ValueError, match=r"\[M, 2I\]"):
        sw.swiglu_fwd(torch.randn(30, 15), lay)
    with pytest.raises(ValueError, match="multiple of 128"):
        sw.swiglu_quant(torch.randn(30, 2 * 96), lay)
    with pytest.raises(ValueError, match="dout must be"):
        sw.swiglu_bwd(torch.randn(30, 16), torch.randn(30, 9), lay)
    with pytest.raises(ValueError, match="row_w must be"):
        sw.swiglu_bwd(torch.randn(30, 16), torch.randn(30, 8), lay, torch.rand(29))
    with pytest.raises(ValueError, match="out must be"):
        sw.swiglu_quant(torch.randn(30, 512), lay, out=(torch.empty(30, 256, dtype=torch.float8_e4m3fn),
                                                        torch.empty(30, 2)))  # scale not MN-major
    with pytest.raises(ValueError, match="dest must be an integer"):
        rw.gather_sum(torch.randn(30, 8), torch.zeros(4, 2), None)
    with pytest.raises(ValueError, match="weight must be"):
        rw.gather_sum(torch.randn(30, 8), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 3))
    with pytest.raises(ValueError, match="2-D"):
        rw.scatter_rows(torch.randn(4, 2, 8), torch.zeros(4, 2, dtype=torch.int64), 30)
    with pytest.raises(ValueError, match="need_grad_w needs"):
        rw.combine_bwd(torch.randn(4, 8), None, torch.zeros(4, 2, dtype=torch.int64), None, 30, True)


def test_kernel_path_rejects_strided_columns(monkeypatch):
    pytest.importorskip("triton")
    from dropless.ops import select

    monkeypatch.setattr(select, "FORCE_TRITON", True)  # the checks run before any launch
    lay = ExpertLayout.from_counts(torch.tensor([5, 0, 9]), 8, capacity=30)
    with pytest.raises(ValueError, match="contiguous"):
        sw.swiglu_fwd(torch.randn(32, 30).t(), lay)
    with pytest.raises(ValueError, match="multiple of 8"):
        sw.swiglu_fwd(torch.randn(30, 2 * 12), lay)
    with pytest.raises(ValueError, match="contiguous"):
        rw.gather_sum(torch.randn(8, 30).t(), torch.zeros(4, 2, dtype=torch.int64), None)


def test_scatter_and_combine_references_match_loops():
    torch.manual_seed(2)
    N, k, M, H = 9, 3, 40, 5
    dest = torch.randperm(M)[: N * k].view(N, k)
    dest[2, 1] = -1
    x = torch.randn(N, H, dtype=torch.float64)
    rows = rw.scatter_rows(x, dest, M)
    for n in range(N):
        for j in range(k):
            if dest[n, j] >= 0:
                assert torch.equal(rows[dest[n, j]], x[n])
    g = torch.randn(N, H, dtype=torch.float64)
    w = torch.rand(N, k, dtype=torch.float64)
    gy, gw = rw.combine_bwd(g, rows, dest, w, M, True)
    for n in range(N):
        for j in range(k):
            d = dest[n, j]
            if d >= 0:
                assert torch.allclose(gy[d], g[n] * w[n, j])
                assert torch.allclose(gw[n, j], (g[n] * rows[d]).sum())
            else:
                assert gw[n, j] == 0
