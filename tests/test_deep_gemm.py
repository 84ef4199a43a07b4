"""``gemm=deep_gemm`` on CPU, against a stand-in for DeepGEMM's API (tests/fake_deep_gemm.py).

What is real here: dropless's side of the call (the 1×128 activation and 128×128 weight
quantisation, the K-major operands, the layout's ``end[]`` as DeepGEMM's psum layout, the
weight cache, the FP8 MLP's forward and backward, the configuration checks). What is not:
DeepGEMM's kernel (the stand-in multiplies the same FP8 operands, dequantised, in fp32).
Bounds as in tests/test_fp8.py (e4m3: 2^-4 relative per operand).
"""

from __future__ import annotations

import pytest
import torch

from dropless import ModelArgs
from dropless.config import ConfigError
from dropless.experts import GroupedExperts
from dropless.layout import ExpertLayout
from dropless.moe import MoE
from dropless.ops import register_backend
from dropless.ops.backends import check_backend_shapes
from dropless.ops.deep_gemm_backend import DeepGemmBackend
from dropless.ops.fp8_quant import dequant_weight_blocks, quant_weight_blocks
from tests import fake_deep_gemm
from tests.conftest import py_layout
from tests.test_fp8 import FP8_GEMM_TOL, assert_experts_match_loop, assert_moe_layer_matches_torch, rel

NAN = float("nan")


@pytest.fixture
def backend():
    fake_deep_gemm.calls.clear()
    be = DeepGemmBackend(module=fake_deep_gemm, emulate=True)
    register_backend("deep_gemm_cpu", lambda: be)
    return be


def _rows(counts, k_dim, seed=0):
    starts, ends = py_layout(counts, 128)
    m = ends[-1] + 5
    lay = ExpertLayout.from_counts(torch.tensor(counts), alignment=128, capacity=m)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k_dim, generator=g)
    x[~lay.live_mask()] = NAN  # gap and tail rows: never read as live rows
    return lay, x, list(zip(starts, ends)), g


def test_weight_blocks_roundtrip_within_one_e4m3_step():
    w = torch.randn(3, 256, 384, generator=torch.Generator().manual_seed(1))
    w[1, :128, 128:256] *= 1e-3  # one block of small values: its own scale keeps their precision
    for cd, w_nk in ((1, w.transpose(1, 2)), (2, w)):
        b, s = quant_weight_blocks(w, contract_dim=cd)
        assert b.is_contiguous() and b.shape == w_nk.shape
        assert s.shape == (3, w_nk.shape[1] // 128, w_nk.shape[2] // 128)
        err = (dequant_weight_blocks(b, s) - w_nk).abs()
        s_full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)
        assert (err <= 2.0 ** -4 * w_nk.abs() + 2.0 ** -10 * s_full).all()
    with pytest.raises(ValueError, match="128x128"):
        quant_weight_blocks(torch.zeros(1, 100, 128))


def test_grouped_gemm_live_rows_and_data_gradient_geometry(backend):
    counts, k_dim, n_dim = [200, 0, 3, 129, 0], 256, 384
    lay, x, seg, g = _rows(counts, k_dim)
    w = torch.randn(len(counts), k_dim, n_dim, generator=g) / k_dim ** 0.5
    out = backend.gmm(x, w, lay)
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], n_dim)
    for i, (s, t) in enumerate(seg):
        if t > s:
            ref = x[s:t].double() @ w[i].double()
            assert 0.005 < rel(out[s:t], ref) < FP8_GEMM_TOL, i
    assert fake_deep_gemm.calls[-1] == dict(m=x.shape[0], n=n_dim, k=k_dim, groups=5, disable_ue8m0_cast=True)
    # the data gradient's geometry (dy @ wᵀ): its own cached copy, the forward's reused
    dy = torch.randn(x.shape[0], n_dim, generator=g)
    dx = backend.gmm(dy, w.transpose(1, 2), lay)
    backend.gmm(x, w, lay)
    assert backend.quantisations == 2
    s, t = seg[0]
    assert 0.005 < rel(dx[s:t], dy[s:t].double() @ w[0].double().t()) < FP8_GEMM_TOL


@pytest.mark.parametrize("opts", [dict(), dict(fold=True), dict(recompute_fc1=True)])
def test_experts_forward_backward_against_float64_and_loop(backend, opts):
    counts, h_dim, i_dim = [150, 0, 40, 9], 128, 256
    lay, x, seg, g = _rows(counts, h_dim, seed=2)
    live = lay.live_mask()
    ex = GroupedExperts(h_dim, i_dim, len(counts), gemm=backend, recompute_fc1=opts.get("recompute_fc1", False))
    ref_ex = GroupedExperts(h_dim, i_dim, len(counts), gemm="loop")
    ex.init_weights(1, 2, std=0.1)
    ref_ex.load_state_dict(ex.state_dict())
    assert_experts_match_loop(ex, ref_ex, x, lay, seg, live, g, fold=opts.get("fold", False))


MOE = dict(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
           topk_group=2, n_shared_experts=1, expert_alignment=128)


def test_moe_layer_matches_torch(backend):
    assert_moe_layer_matches_torch(MOE, MoE(ModelArgs(**MOE, gemm="deep_gemm_cpu"), layer_id=1))
    assert backend.quantisations == 4  # w13 and w2, forward and data-gradient copies, once each


def test_configuration_errors(backend):
    with pytest.raises(ConfigError, match="model.expert_alignment=128"):
        MoE(ModelArgs(**dict(MOE, expert_alignment=16), gemm="deep_gemm_cpu"), layer_id=1)
    with pytest.raises(ConfigError, match="multiples of 128"):
        check_backend_shapes("deep_gemm_cpu", "cpu", torch.float32, 64, 128)
    with pytest.raises(ConfigError, match="compute capability >= 9.0"):
        DeepGemmBackend(module=fake_deep_gemm).check_device("cpu")
    lay, x, _, _ = _rows([5, 7], 128)
    bad = ExpertLayout.from_counts(torch.tensor([5, 7]), alignment=64, capacity=lay.capacity)
    with pytest.raises(ValueError, match="expert_alignment=128"):
        backend.gmm(x, torch.randn(2, 128, 128), bad)


def test_old_package_is_a_config_error(monkeypatch):
    """A deep_gemm without the psum-layout grouped GEMM (the package missing: tests/test_fp8.py)."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    with pytest.raises(ConfigError, match="m_grouped_fp8_gemm_nt_contiguous"):
        DeepGemmBackend()
