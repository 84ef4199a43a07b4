"""``gemm=fp8`` on CPU: quantisation, layout, weight cache and backward logic through the GEMM's emulation.

``Fp8Backend(emulate=True)`` runs the same FP8 operands as the CUDA kernel would (quantised by
the same code), dequantised, through one fp32 matmul per expert; tests/test_fp8_gpu.py checks
the real kernel against it. References are float64.

Error bounds used here. e4m3 keeps 3 mantissa bits: a value in the normal range rounds to
within 2^-4 of itself (relative); the smallest scaled values (below 2^-6 · scale) are
subnormal, absolute error <= 2^-10 · scale. A GEMM whose two operands each carry that error
has a relative (Frobenius) error near sqrt(2) · 2^-4 / sqrt(3) ≈ 0.05 on Gaussian data;
tests bound it by 0.06 and check that it is not tiny (> 0.005: the operands really were FP8).
The experts' FC1 -> SwiGLU -> FC2 chain quantises four operands: bound 0.1 (gradients 0.12).
The weight gradients are bf16/fp32 GEMMs (fp32 on CPU): 1e-5 of the fp64 reference; with
``wgrad="fp8"`` / ``"fp8_expert"`` both operands are FP8 along the rows: the GEMM bound, 0.06.
"""

from __future__ import annotations

import pytest
import torch

from dropless import ModelArgs
from dropless.config import ConfigError
from dropless.experts import GroupedExperts
from dropless.layout import ExpertLayout
from dropless.moe import MoE
from dropless.ops import get_backend, grouped_mm, list_backends
from dropless.ops.backends import check_backend_device
from dropless.ops.fp8_backend import Fp8Backend
from dropless.ops.fp8_quant import (
    FP8_MAX,
    dequant_rows,
    dequant_weight,
    quant_expert_columns,
    quant_rows,
    quant_token_blocks,
    quant_weight,
    swiglu_quant_rows,
)
from dropless.ops.ue8m0 import amax_scale, pow2_ceil
from tests.conftest import py_layout
from tests.ue8m0_sweep import (
    amax_sweep,
    case_quant_expert_columns,
    case_quant_rows,
    case_quant_token_blocks,
    case_quant_weight,
    case_quant_weight_blocks,
    case_swiglu_quant,
    case_swiglu_quant_rows,
    check_scales,
)

NAN = float("nan")
EMPTY_EXPERT_COUNTS = [162, 0, 2577, 446, 0, 83]
FP8_GEMM_TOL = 0.06
FP8_MLP_TOL = 0.1  # FC1 -> SwiGLU -> FC2: four quantised operands, sqrt(4) · 2^-4 / sqrt(3) ≈ 0.07


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def make(counts, a=1, k_dim=64, n_dim=32, seed=0, dtype=torch.float32):
    starts, ends = py_layout(counts, a)
    m = ends[-1] + 3
    lay = ExpertLayout.from_counts(torch.tensor(counts), alignment=a, capacity=m)
    g = torch.Generator().manual_seed(seed)
    live = lay.live_mask()
    x = torch.randn(m, k_dim, generator=g).to(dtype)
    x[~live] = NAN
    w = (torch.randn(len(counts), k_dim, n_dim, generator=g) / k_dim ** 0.5).to(dtype)
    return lay, x, w, list(zip(starts, ends)), live, g


# ---------------------------------------------------------------------------- quantisation
def test_quant_rows_scales_and_rounding_bound():
    lay, x, _, seg, live, _ = make([5, 0, 17, 3], a=8, k_dim=256)
    x[live] *= torch.logspace(-3, 3, int(live.sum())).unsqueeze(1)  # rows of very different magnitude
    q, s = quant_rows(x, lay)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (x.shape[0],)
    xl = x[live].double()
    torch.testing.assert_close(s[live].double(), xl.abs().amax(1) / FP8_MAX, rtol=1e-6, atol=0)
    assert q[live].float().abs().amax(1).eq(FP8_MAX).all()  # the row's amax maps onto 448
    err = (dequant_rows(q[live], s[live]).double() - xl).abs()
    bound = 2.0 ** -4 * xl.abs() + 2.0 ** -10 * s[live].double().unsqueeze(1)
    assert (err <= bound).all()


def test_quant_rows_ue8m0_power_of_two():
    lay, x, _, _, live, _ = make([7, 9], k_dim=128)
    q, s = quant_rows(x, lay, ue8m0=True)
    ls = torch.log2(s[live])
    assert torch.equal(ls, ls.round()) and (s[live] >= x[live].abs().amax(1) / FP8_MAX).all()
    assert q[live].float().abs().max() <= FP8_MAX


def test_quant_rows_nonfinite_live_row_raises_padding_ignored():
    lay, x, _, seg, live, _ = make([4, 6], a=8, k_dim=32)
    quant_rows(x, lay)  # NaN only in padding rows: fine
    bad = x.clone()
    bad[seg[1][0] + 2, 5] = float("inf")
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        quant_rows(bad, lay)
    bad[seg[1][0] + 2, 5] = NAN
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        swiglu_quant_rows(bad, lay)


def test_swiglu_quant_rows_matches_fp64():
    lay, h13, _, _, live, _ = make([33, 0, 12], a=4, k_dim=2 * 128)
    q, s = swiglu_quant_rows(h13, lay)
    assert q.shape == (h13.shape[0], 128)
    hd = h13[live].double()
    a = torch.nn.functional.silu(hd[:, :128]) * hd[:, 128:]
    torch.testing.assert_close(s[live].double(), a.abs().amax(1) / FP8_MAX, rtol=1e-6, atol=0)
    err = (dequant_rows(q[live], s[live]).double() - a).abs()
    assert (err <= 2.0 ** -4 * a.abs() + 2.0 ** -10 * s[live].double().unsqueeze(1) + 1e-7).all()


@pytest.mark.parametrize("contract_dim", [1, 2])
def test_quant_weight_layout_and_bound(contract_dim):
    w = torch.randn(3, 64, 48) * torch.logspace(-2, 2, 48)
    op = w if contract_dim == 1 else w.transpose(1, 2)  # the GEMM's right operand [e, K, N]
    b, s = quant_weight(op, contract_dim=1)
    k, n = op.shape[1:]
    assert b.shape == (3, k, n) and b.stride(1) == 1 and b.stride(2) == k  # column-major, as the kernel needs
    assert s.shape == (3, n)
    torch.testing.assert_close(s.double(), op.double().abs().amax(1) / FP8_MAX, rtol=1e-6, atol=0)
    err = (dequant_weight(b, s).double() - op.double()).abs()
    assert (err <= 2.0 ** -4 * op.double().abs() + 2.0 ** -10 * s.double().unsqueeze(1)).all()
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        quant_weight(torch.full((1, 16, 16), NAN))


# ---------------------------------------------------------------------------- the grouped GEMM
def reference(x, w, seg, dy):
    xd, wd, dyd = x.double(), w.double(), dy.double()
    out, dx, dw = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64), torch.zeros(x.shape, dtype=torch.float64), \
        torch.zeros(w.shape, dtype=torch.float64)
    for i, (s, t) in enumerate(seg):
        out[s:t], dx[s:t], dw[i] = xd[s:t] @ wd[i], dyd[s:t] @ wd[i].t(), xd[s:t].t() @ dyd[s:t]
    return out, dx, dw


@pytest.mark.parametrize("a", [1, 8, 128])
def test_grouped_mm_fp8_emulated_live_rows(a):
    """Forward and dX in FP8 (bounded error vs fp64, NaN padding never reaches them), dW in fp32, empty dW == 0."""
    be = Fp8Backend(emulate=True)
    lay, x, w, seg, live, g = make(EMPTY_EXPERT_COUNTS, a, k_dim=64, n_dim=32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = grouped_mm(x, w, lay, be)
    dy = torch.randn(out.shape, generator=g)
    dy[~live] = NAN
    out.backward(dy)
    ref_out, ref_dx, ref_dw = reference(x.detach(), w.detach(), seg, dy)
    errs = {"fwd": rel(out[live], ref_out[live]), "dgrad": rel(x.grad[live], ref_dx[live])}
    for what, e in errs.items():
        assert 0.005 < e < FP8_GEMM_TOL, (what, e)
    assert torch.isfinite(w.grad).all()
    assert rel(w.grad, ref_dw) < 1e-5  # the weight gradient is not FP8
    for i, c in enumerate(EMPTY_EXPERT_COUNTS):
        if c == 0:
            assert torch.equal(w.grad[i], torch.zeros_like(w.grad[i]))
    # the emulation is exactly "dequantised FP8 operands, fp32 GEMM": rebuild it here
    xq, xs = quant_rows(x.detach(), lay)
    b, bs = quant_weight(w.detach())
    manual = torch.zeros_like(ref_out)
    for i, (s, t) in enumerate(seg):
        manual[s:t] = dequant_rows(xq[s:t], xs[s:t]).double() @ dequant_weight(b, bs)[i].double()
    assert rel(out[live], manual[live]) < 1e-6


def test_quant_token_blocks_and_expert_columns_bound_live_rows_only():
    """The row-contracted operands of the FP8 weight gradient (torch references, CPU): codes transposed
    ``[K, M']`` (M' = M rounded up to 128); one scale per column per 128-row block, or per column per
    expert; within one e4m3 step of x on live rows (the module docstring's bound); the rows past an
    expert's end inside its last block are zero codes; NaN padding never reaches a scale; a NaN in a live row raises; an
    alignment that is not a multiple of 128 is refused, naming model.expert_alignment."""
    lay, x, _, seg, live, _ = make(EMPTY_EXPERT_COUNTS, a=128, k_dim=64)
    x[live] *= torch.logspace(-2, 2, 64).unsqueeze(0)  # columns of very different magnitude
    m = x.shape[0]
    mp = -(-m // 128) * 128
    rex = lay.row_expert()
    for quant, n_scales in ((quant_token_blocks, mp // 128), (quant_expert_columns, len(EMPTY_EXPERT_COUNTS))):
        q, s = quant(x, lay)
        assert q.shape == (64, mp) and q.dtype == torch.float8_e4m3fn and s.shape == (n_scales, 64)
        assert torch.isfinite(s).all()
        srow = s.repeat_interleave(128, 0)[:m] if quant is quant_token_blocks else s[rex.clamp_min(0)]
        deq = q.t()[:m].float() * srow
        # normal range: 2^-4 relative; subnormal codes (below 2^-6 · scale): 2^-10 · scale absolute
        bound = torch.maximum(2 ** -4 * x[live].abs(), 2 ** -10 * srow[live]) * (1 + 1e-6)
        assert ((deq[live] - x[live]).abs() <= bound).all(), quant.__name__
        # scales: each block's / expert's live amax over 448
        if quant is quant_token_blocks:
            blk = torch.arange(m) // 128
            for b in blk[live].unique().tolist():
                rows = live & (blk == b)
                assert torch.equal(s[b], x[rows].abs().amax(0) / FP8_MAX)
        else:
            for i, (s0, t) in enumerate(seg):
                if t > s0:
                    assert torch.equal(s[i], x[s0:t].abs().amax(0) / FP8_MAX)
        for s0, t in seg:  # zero codes from each expert's end to its block boundary
            if t > s0:
                assert (q[:, t:-(-t // 128) * 128].float() == 0).all()
        x2 = x.clone()
        x2[torch.nonzero(live)[7, 0], 3] = NAN
        with pytest.raises(RuntimeError, match="NaN or Inf"):
            quant(x2, lay)
    lay16, x16, *_ = make([5, 9], a=16)
    with pytest.raises(ValueError, match="expert_alignment"):
        quant_token_blocks(x16, lay16)


@pytest.mark.parametrize("mode", ["fp8", "fp8_expert"])
def test_fp8_weight_gradient_emulated(mode):
    """``wgrad="fp8"`` (128-row block scales) and ``"fp8_expert"`` (per-expert column scales): dW within
    the FP8 GEMM bound of fp64 (and not exact: FP8 ran), exactly the dequantised codes' product, exact 0
    for an empty expert, NaN padding rows ignored; the accumulating form adds onto dw; a layout whose
    alignment is not a multiple of 128 is refused (ValueError) and so is the config (ConfigError)."""
    lay, x, _, seg, live, g = make(EMPTY_EXPERT_COUNTS, a=128, k_dim=64)
    dy = torch.randn(x.shape[0], 32, generator=g)
    dy[~live] = NAN
    be = Fp8Backend(emulate=True, wgrad=mode)
    dw = be.gmm_wgrad(x, dy, lay)
    assert dw.shape == (len(EMPTY_EXPERT_COUNTS), 64, 32) and dw.dtype == x.dtype
    quant = quant_token_blocks if mode == "fp8" else quant_expert_columns
    (aq, a_s), (bq, b_s) = quant(x, lay), quant(dy, lay)
    a, b = be._dequant_cols(aq, a_s, lay).double(), be._dequant_cols(bq, b_s, lay).double()
    for i, (s0, t) in enumerate(seg):
        if t == s0:
            assert torch.equal(dw[i], torch.zeros_like(dw[i]))
            continue
        exact = x[s0:t].double().t() @ dy[s0:t].double()
        assert 0.005 < rel(dw[i], exact) < FP8_GEMM_TOL, i
        assert rel(dw[i], a[s0:t].t() @ b[s0:t]) < 1e-6
    acc = torch.randn(dw.shape, generator=g)
    acc0 = acc.clone()
    be.gmm_wgrad_acc_(acc, x, dy, lay)
    assert rel(acc - acc0, dw) < 1e-6
    lay16, x16, *_ = make([5, 9], a=16)
    with pytest.raises(ValueError, match="multiple of 128"):
        be.gmm_wgrad(x16, x16[:, :32].clone(), lay16)
    with pytest.raises(ConfigError, match="expert_alignment"):
        be.check_alignment(16)
    Fp8Backend(emulate=True).check_alignment(16)  # the bf16 weight gradient takes any alignment
    with pytest.raises(ValueError, match="wgrad"):
        Fp8Backend(wgrad="fp16")


def test_weight_cache_reuse_and_requantise_after_inplace_update():
    be = Fp8Backend(emulate=True)
    lay, x, w, seg, live, _ = make([10, 20], k_dim=32, n_dim=16)
    w = torch.nn.Parameter(w)
    y1 = be.gmm(x, w, lay)
    assert be.quantisations == 1
    y2 = be.gmm(x, w, lay)
    assert be.quantisations == 1 and torch.equal(y1[live], y2[live])  # reused
    be.gmm(x, w.transpose(1, 2).transpose(1, 2), lay)
    assert be.quantisations == 1  # a view with the same geometry reuses the parent's copy
    be.gmm(torch.randn(x.shape[0], 16), w.transpose(1, 2), lay)  # the data gradient's operand: its own copy
    assert be.quantisations == 2
    with torch.no_grad():
        w.mul_(2.0)  # the optimizer's in-place step moves _version
    y3 = be.gmm(x, w, lay)
    assert be.quantisations == 3
    assert rel(y3[live], 2 * y1[live]) < 1e-6
    # a cast copy registered as the parameter's alias hits the parameter's entry
    c = be.alias(w.detach().clone(), w)
    be.gmm(x, c, lay)
    assert be.quantisations == 3
    # new storage (p.data = ...) requantises; torch._foreach_copy_ (the trainer's refresh) moves _version
    w.data = w.data * 0.5
    assert rel(be.gmm(x, w, lay)[live], y1[live]) < 1e-6 and be.quantisations == 4
    with torch.no_grad():
        torch._foreach_copy_([w], [w * 3.0])
    assert rel(be.gmm(x, w, lay)[live], 3 * y1[live]) < 1e-6 and be.quantisations == 5
    be.clear_cache()
    be.gmm(x, w, lay)
    assert be.quantisations == 6


def test_fp8_backend_registered_and_device_errors():
    assert {"fp8", "deep_gemm"} <= set(list_backends())
    with pytest.raises(ConfigError, match="compute capability >= 8.9"):
        check_backend_device("fp8", "cpu")
    with pytest.raises(ConfigError, match="compute capability >= 8.9"):
        get_backend("fp8").check(torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(1, 16, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Backend(emulate=True).check(torch.zeros(4, 24), torch.zeros(1, 24, 16))
    check_backend_device("torch", "cpu")


def test_deep_gemm_missing_is_a_config_error():
    pytest.importorskip("torch")
    try:
        import deep_gemm  # noqa: F401
        pytest.skip("deep_gemm is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="deep_gemm package"):
        get_backend("deep_gemm")
    with pytest.raises(ConfigError, match="deep_gemm package"):
        MoE(ModelArgs(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                      topk_group=1, gemm="deep_gemm"), layer_id=1)


# ---------------------------------------------------------------------------- experts and the MoE layer
def experts_ref(x, w13, w2, seg, row_w=None):
    """float64 FC1 -> SwiGLU (× row weight) -> FC2 of the live rows."""
    xd = x.double()
    y = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float64)
    i_dim = w2.shape[1]
    for i, (s, t) in enumerate(seg):
        h = xd[s:t] @ w13[i].double()
        a = torch.nn.functional.silu(h[:, :i_dim]) * h[:, i_dim:]
        if row_w is not None:
            a = a * row_w[s:t].double().unsqueeze(1)
        y[s:t] = a @ w2[i].double()
    return y


def assert_experts_match_loop(ex, ref_ex, x, lay, seg, live, g, fold=False, empty=1):
    """FP8 experts ``ex`` against float64 (forward: a real FP8 error, 0.005 < rel < FP8_MLP_TOL) and
    against the ``loop`` experts ``ref_ex`` with the same weights (gradients of x, W13, W2 and the
    folded row weight within 1.2·FP8_MLP_TOL; expert ``empty`` gets an exactly zero dW). Padding rows
    of ``dy`` are NaN. Shared by ``gemm=fp8`` and ``gemm=deep_gemm``."""
    row_w = torch.rand(x.shape[0], generator=g) if fold else None
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    rws = [row_w.clone().requires_grad_(True) if row_w is not None else None for _ in range(2)]
    y = ex(xs[0], lay, rws[0])
    y_ref = ref_ex(xs[1], lay, rws[1])
    err = rel(y[live], experts_ref(x, ex.w13.detach(), ex.w2.detach(), seg, row_w)[live])
    assert 0.005 < err < FP8_MLP_TOL
    dy = torch.randn(y.shape, generator=g)
    dy[~live] = NAN
    y.backward(dy)
    y_ref.backward(dy)
    assert rel(xs[0].grad[live], xs[1].grad[live]) < 1.2 * FP8_MLP_TOL
    for p, q in ((ex.w13, ref_ex.w13), (ex.w2, ref_ex.w2)):
        assert torch.isfinite(p.grad).all()
        assert rel(p.grad, q.grad) < 1.2 * FP8_MLP_TOL
        assert torch.equal(p.grad[empty], torch.zeros_like(p.grad[empty]))  # the empty expert
    if row_w is not None:
        assert rel(rws[0].grad[live], rws[1].grad[live]) < 1.2 * FP8_MLP_TOL


@pytest.mark.parametrize("opts", [dict(), dict(fold=True), dict(recompute_swiglu=True), dict(recompute_fc1=True),
                                  dict(poison=True)])
def test_grouped_experts_fp8_paths(opts):
    """Every experts path with gemm=fp8 (emulated) against float64; gradients against loop fp32."""
    torch.manual_seed(0)
    counts, h_dim, i_dim = [40, 0, 75, 9], 64, 128
    lay, x, _, seg, live, g = make(counts, a=16, k_dim=h_dim)
    kw = dict(recompute_swiglu=opts.get("recompute_swiglu", False), recompute_fc1=opts.get("recompute_fc1", False),
              poison=opts.get("poison", False))
    ex = GroupedExperts(h_dim, i_dim, len(counts), gemm=Fp8Backend(emulate=True), **kw)
    ref_ex = GroupedExperts(h_dim, i_dim, len(counts), gemm="loop")
    ex.init_weights(1, 2, std=0.1)
    ref_ex.load_state_dict(ex.state_dict())
    assert_experts_match_loop(ex, ref_ex, x, lay, seg, live, g, fold=opts.get("fold", False))


MOE_SMALL = dict(hidden_size=64, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                 topk_group=2, n_shared_experts=1, expert_alignment=16)


def assert_moe_layer_matches_torch(args: dict, m8: MoE) -> None:
    """``m8`` (an MoE layer of ``args`` on an FP8 backend) against gemm=torch fp32 with the same weights:
    outputs within the FP8 bound (and not equal: FP8 really ran), the input's and every parameter's gradient."""
    mt = MoE(ModelArgs(**args, gemm="torch"), layer_id=1)
    m8.init_weights(3)
    mt.load_state_dict(m8.state_dict())
    x = torch.randn(2, 48, args["hidden_size"], generator=torch.Generator().manual_seed(4))
    x8, xt = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y8, yt = m8(x8), mt(xt)
    assert 0.001 < rel(y8, yt) < FP8_MLP_TOL
    dy = torch.randn(y8.shape, generator=torch.Generator().manual_seed(5))
    y8.backward(dy)
    yt.backward(dy)
    assert rel(x8.grad, xt.grad) < 1.2 * FP8_MLP_TOL
    for (n, p), q in zip(m8.named_parameters(), mt.parameters()):
        if q.grad is not None:
            assert p.grad is not None and rel(p.grad, q.grad) < 1.2 * FP8_MLP_TOL, n


@pytest.mark.parametrize("extra", [dict(), dict(num_token_chunks=2), dict(recompute_gather=True),
                                   dict(recompute_fc1=True, num_token_chunks=2), dict(fold_routing_weights=True)])
def test_moe_layer_fp8_matches_torch(extra):
    """The whole MoE layer with gemm=fp8 (emulated) against gemm=torch fp32: outputs and every gradient."""
    args = dict(MOE_SMALL, **extra)
    m8 = MoE(ModelArgs(**args, gemm="fp8"), layer_id=1)
    m8.experts.backend = Fp8Backend(emulate=True)
    assert_moe_layer_matches_torch(args, m8)


def test_fp8_weights_quantised_once_for_chunks_and_microbatches():
    """Chunks, backward, two micro-batches: each weight's two FP8 copies made once, again after a step."""
    m = MoE(ModelArgs(**MOE_SMALL, num_token_chunks=2, gemm="fp8"), layer_id=1)
    be = m.experts.backend = Fp8Backend(emulate=True)
    m.init_weights(3)
    for mb in range(2):
        x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(mb), requires_grad=True)
        m(x).square().sum().backward()
    assert be.quantisations == 4  # w13, w2: a forward copy and a data-gradient copy each
    with torch.no_grad():
        for p in m.experts.parameters():
            p.sub_(0.01 * p.grad)
    m(torch.randn(1, 40, 64, requires_grad=True)).sum().backward()
    assert be.quantisations == 8


def test_torch_compile_of_fp8_moe_runs_the_fp8_nodes_eagerly():
    """``torch.compile`` of an MoE with gemm=fp8: the FP8 nodes run eagerly (graph breaks); same result as eager."""
    torch.manual_seed(0)
    m = MoE(ModelArgs(**MOE_SMALL, gemm="fp8"), layer_id=1)
    m.experts.backend = Fp8Backend(emulate=True)
    m.init_weights(3)
    x = torch.randn(1, 32, 64)
    xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ye = m(xe)
    ye.sum().backward()
    ge = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    yc = torch.compile(m, backend="aot_eager")(xc)
    yc.sum().backward()
    assert rel(yc, ye) < 1e-6 and rel(xc.grad, xe.grad) < 1e-6
    for n, p in m.named_parameters():
        if n in ge:
            assert rel(p.grad, ge[n]) < 1e-5, n


def test_trainer_refuses_gemm_fp8_without_fp8_gpu(tmp_path, capsys):
    """``gemm=fp8`` on this CPU: a configuration error at trainer start (exit 2), before any step."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has FP8 tensor cores")
    pytest.importorskip("hydra")
    from dropless.train.__main__ import main

    assert main(["gemm=fp8", "train.steps=1", f"run_dir={tmp_path / 'run'}", "logging.mode=disabled"]) == 2
    err = capsys.readouterr().err
    assert "gemm=fp8 needs" in err and "compute capability >= 8.9" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------------------- power-of-two (UE8M0) scales
SWEEP = amax_sweep(-40, 100)  # 448·2^k and its fp32 neighbours; amax >= 1e-10 (every op's floor)
UE8M0_CASES = {
    "quant_rows": lambda a: case_quant_rows(a, "cpu"),
    "quant_rows_1x128": lambda a: case_quant_rows(a, "cpu", group=128),
    "swiglu_quant_rows": lambda a: case_swiglu_quant_rows(a, "cpu"),
    "swiglu_quant_rows_1x128": lambda a: case_swiglu_quant_rows(a, "cpu", group=128),
    "swiglu_quant": lambda a: case_swiglu_quant(a, "cpu"),
    "quant_token_blocks": lambda a: case_quant_token_blocks(a, "cpu"),
    "quant_expert_columns": lambda a: case_quant_expert_columns(a, "cpu"),
    "quant_weight": lambda a: case_quant_weight(a, "cpu", 1),
    "quant_weight_contract2": lambda a: case_quant_weight(a, "cpu", 2),
    "quant_weight_blocks": lambda a: case_quant_weight_blocks(a[::4], "cpu"),
}


@pytest.mark.parametrize("name", list(UE8M0_CASES))
def test_ue8m0_scale_is_the_exact_power_of_two_ceiling(name):
    """Every torch quantiser: at, one fp32 step below and one above 448·2^k, the scale is the smallest
    power of two with amax / scale <= 448, DeepGEMM's bit for bit (fp32 log2 rounds 2^k·(1 + 2^-23)
    down to k, which gave 2^k there: the largest element clipped)."""
    scale, amax = UE8M0_CASES[name](SWEEP)
    check_scales(amax, scale, name)


def test_pow2_ceil_matches_the_bit_rule_on_every_exponent():
    """:func:`pow2_ceil` on every fp32 exponent (subnormals too), at, below and above each power of two."""
    p = torch.ldexp(torch.ones(277), torch.arange(-149, 128))
    s = torch.cat([p, torch.nextafter(p, torch.zeros_like(p)), torch.nextafter(p, torch.full_like(p, float("inf")))])
    s = s[(s > 0) & torch.isfinite(s)]
    got = pow2_ceil(s)
    m, e = torch.frexp(s.double())
    want = torch.ldexp(torch.ones_like(s, dtype=torch.float64), e - (m == 0.5).long())
    assert torch.equal(got, want.float())  # 2^128 overflows to inf
    assert torch.equal(pow2_ceil(torch.tensor([float("inf"), 3e38])), torch.tensor([float("inf"), float("inf")]))
    assert pow2_ceil(torch.tensor([float("nan")])).isnan().all()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_amax_scale_is_the_round_to_nearest_quotient_on_every_device(device):
    """``amax / 448`` as the kernels' ``div_rn`` gives it: the fp64 quotient rounded once to fp32, for every
    amax of a sweep over many exponents and mantissas (on CUDA a host-scalar divisor would be a multiply by
    the rounded reciprocal, one ulp off for some of them)."""
    g = torch.Generator().manual_seed(0)
    exp = torch.randint(-30, 40, (20000,), generator=g)  # amax above the 1e-12 floor
    amax = torch.ldexp(1 + torch.rand(20000, generator=g), exp)
    amax = amax.float().to(device)
    want = (amax.double() / 448.0).float()  # fp64 is wide enough that rounding twice is rounding once
    assert torch.equal(amax_scale(amax, 1e-12), want)
