"""Tests of dropless.ops.grouped_mm over a live-row layout (backends ``torch`` and ``loop``).

Reference: a float64 per-expert loop, ``out[s:t] = x[s:t] @ w[i]``,
``dX[s:t] = dY[s:t] @ w[i]^T``, ``dW[i] = x[s:t]^T @ dY[s:t]`` with ``[s, t)`` the
expert's live rows from the recurrence of docs/design.md#the-live-row-contract. Padding rows of ``x`` and of the
upstream gradient hold NaN: they must reach no live output row, no ``dX`` live row
and no ``dW`` (rule 2); an empty expert's ``dW`` is exactly 0 (rule 4).

Tolerances (max |error| over the tensor / max |reference|, per expert):
fp32 1e-5 (K <= 2577-row sums in fp32); bf16 1e-2 (one bf16 rounding of the
output, 2^-8 ≈ 3.9e-3, with margin); loop fp64 1e-12.
"""

from __future__ import annotations

import pytest
import torch

from dropless.layout import ExpertLayout
from dropless.ops import get_backend, grouped_mm, list_backends
from tests.conftest import py_layout

NAN = float("nan")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}
BACKENDS = [("torch", torch.float32), ("torch", torch.bfloat16), ("loop", torch.float64)]
EMPTY_EXPERT_COUNTS = [162, 0, 2577, 446, 0, 83]


def py_segments(counts, a):
    """``[(start, end)]`` of each expert (:func:`tests.conftest.py_layout`)."""
    return list(zip(*py_layout(counts, a)))


def make(counts, a=1, extra=0, k_dim=64, n_dim=32, dtype=torch.float32, seed=0):
    """Layout, x [M, K] with NaN padding, w [e, K, N], the live-row segments and the live mask."""
    seg = py_segments(counts, a)
    m = seg[-1][1] + extra
    lay = ExpertLayout.from_counts(torch.tensor(counts), alignment=a, capacity=m)
    g = torch.Generator().manual_seed(seed)
    live = torch.zeros(m, dtype=torch.bool)
    for s, t in seg:
        live[s:t] = True
    x = torch.randn(m, k_dim, generator=g).to(dtype)
    x[~live] = NAN
    w = (torch.randn(len(counts), k_dim, n_dim, generator=g) / k_dim ** 0.5).to(dtype)
    return lay, x, w, seg, live, g


def reference(x, w, seg, dy):
    """float64 per-expert forward, dX and dW from the live rows only."""
    xd, wd, dyd = x.double(), w.double(), dy.double()
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    dx = torch.zeros(x.shape, dtype=torch.float64)
    dw = torch.zeros(w.shape, dtype=torch.float64)
    for i, (s, t) in enumerate(seg):
        out[s:t] = xd[s:t] @ wd[i]
        dx[s:t] = dyd[s:t] @ wd[i].t()
        dw[i] = xd[s:t].t() @ dyd[s:t]
    return out, dx, dw


def assert_close_scaled(got, want, tol, what):
    got = got.double()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    scale = want.abs().max().clamp_min(1e-30)
    err = (got - want).abs().max() / scale
    assert err <= tol, f"{what}: max error {err:.3e} of max |ref| > {tol:.0e}"


def run(counts, backend, dtype, a=1, extra=0, upstream="random", k_dim=64, n_dim=32, seed=0):
    lay, x, w, seg, live, g = make(counts, a, extra, k_dim, n_dim, dtype, seed)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = grouped_mm(x, w, lay, backend)
    assert out.shape == (x.shape[0], n_dim) and out.dtype == dtype
    if upstream == "sum":
        # d sum(out) / d out is a zero-stride expanded tensor of ones
        out.sum().backward()
        dy = torch.ones(out.shape, dtype=dtype)
    elif upstream == "noncontig":
        gt = torch.randn(n_dim, x.shape[0], generator=g).to(dtype)
        (out.t() * gt).sum().backward()  # the gradient reaching out is gt.t(), non-contiguous
        dy = gt.t().contiguous()
    else:
        dy = torch.randn(out.shape, generator=g).to(dtype)
        dy[~live] = NAN                  # padding rows of the upstream gradient hold NaN
        out.backward(dy)
    ref_out, ref_dx, ref_dw = reference(x.detach(), w.detach(), seg, dy)
    tol = TOL[dtype]
    for i, (s, t) in enumerate(seg):
        if t == s:
            assert torch.equal(w.grad[i], torch.zeros_like(w.grad[i])), f"dW[{i}] of an empty expert != 0"
            continue
        assert_close_scaled(out.detach()[s:t], ref_out[s:t], tol, f"out rows of expert {i}")
        assert_close_scaled(x.grad[s:t], ref_dx[s:t], tol, f"dX rows of expert {i}")
        assert_close_scaled(w.grad[i], ref_dw[i], tol, f"dW[{i}]")
    assert torch.isfinite(w.grad).all()
    return lay, out, x.grad, w.grad


# ----------------------------------------------------------------- empty experts (pytorch/pytorch#172439)
@pytest.mark.parametrize("backend, dtype", BACKENDS)
@pytest.mark.parametrize("upstream", ["sum", "random", "noncontig"])
def test_empty_experts_weight_grad_is_exactly_zero(backend, dtype, upstream):
    """Empty experts (pytorch/pytorch#172439): rows [162, 0, 2577, 446, 0, 83], K=64, N=32: dW[1], dW[4] are 0."""
    _, _, _, dw = run(EMPTY_EXPERT_COUNTS, backend, dtype, upstream=upstream)
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))
    assert torch.equal(dw[4], torch.zeros_like(dw[4]))
    assert (dw[[0, 2, 3, 5]].abs().amax(dim=(1, 2)) > 0).all()


@pytest.mark.parametrize("backend, dtype", BACKENDS)
@pytest.mark.parametrize("a, extra", [(8, 0), (128, 0), (128, 300)])
def test_empty_experts_with_nan_padding(backend, dtype, a, extra):
    """The same counts with aligned starts and a capacity larger than needed; padding is NaN."""
    lay, out, dx, dw = run(EMPTY_EXPERT_COUNTS, backend, dtype, a=a, extra=extra, seed=1)
    assert int(lay.start[2]) % a == 0
    assert torch.equal(dw[1], torch.zeros_like(dw[1])) and torch.equal(dw[4], torch.zeros_like(dw[4]))


# ----------------------------------------------------------------- an empty group in backward
@pytest.mark.parametrize("backend, dtype", BACKENDS)
@pytest.mark.parametrize("a", [1, 128])
def test_backward_with_an_empty_group_completes(backend, dtype, a):
    """An empty group (NVIDIA/TransformerEngine#3019), rows [16, 0, 16, 16]: backward finishes, dW[1] == 0."""
    _, _, _, dw = run([16, 0, 16, 16], backend, dtype, a=a, extra=5, upstream="random", seed=2)
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))


@pytest.mark.parametrize("backend, dtype", BACKENDS)
def test_all_experts_empty(backend, dtype):
    lay, x, w, seg, live, _ = make([0, 0, 0], a=8, extra=16, dtype=dtype)
    w.requires_grad_(True)
    x.requires_grad_(True)
    out = grouped_mm(x, w, lay, backend)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend, dtype", BACKENDS)
def test_single_expert_and_row_counts_one(backend, dtype):
    run([1, 1, 1, 1, 1], backend, dtype, a=8, extra=3, seed=3)
    run([300], backend, dtype, a=128, extra=1, seed=4)


def test_bf16_close_to_fp32():
    """Both torch dtypes agree on the live rows (bf16 tolerance)."""
    _, out32, dx32, dw32 = run(EMPTY_EXPERT_COUNTS, "torch", torch.float32, a=8, seed=5)
    _, out16, dx16, dw16 = run(EMPTY_EXPERT_COUNTS, "torch", torch.bfloat16, a=8, seed=5)
    # same inputs up to the bf16 rounding of x and w: compare dW
    assert_close_scaled(dw16, dw32.double(), 3e-2, "bf16 vs fp32 dW")


# ----------------------------------------------------------------- errors
def test_errors_are_clear():
    lay, x, w, seg, live, _ = make([3, 0, 5], a=1, k_dim=8, n_dim=8)
    with pytest.raises(ValueError, match=r"need x \[M, K\] and w \[e, K, N\]"):
        grouped_mm(x[0], w, lay)
    with pytest.raises(ValueError, match=r"need x \[M, K\]"):
        grouped_mm(x, w[0], lay)
    with pytest.raises(ValueError, match=r"need x \[M, K\]"):
        grouped_mm(x[:, :4], w, lay)                      # K mismatch
    with pytest.raises(ValueError, match="layout has 3 experts and capacity 8"):
        grouped_mm(x, w[:2], lay)
    with pytest.raises(ValueError, match="layout has 3 experts and capacity 8"):
        grouped_mm(torch.cat([x, x]), w, lay)
    with pytest.raises(ValueError, match="cast one of them"):
        grouped_mm(x, w.bfloat16(), lay)
    with pytest.raises(ValueError, match="gemm=torch.*float64.*use gemm=loop"):
        grouped_mm(x.double(), w.double(), lay, "torch")
    with pytest.raises(ValueError, match="gemm=torch.*multiple of 16 bytes"):
        lay3, x3, w3, *_ = make([3, 0, 5], k_dim=3, n_dim=8)
        grouped_mm(x3, w3, lay3, "torch")
    with pytest.raises(ValueError, match="gemm=loop: floating operands"):
        grouped_mm(x.int(), w.int(), lay, "loop")
    with pytest.raises(ValueError, match=r"gemm='nope': unknown grouped GEMM backend.*'loop'.*'torch'"):
        grouped_mm(x, w, lay, "nope")
    assert {"torch", "loop"} <= set(list_backends())
    assert get_backend("loop").name == "loop" and get_backend("torch").name == "torch"


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("loop", torch.float64)])
@pytest.mark.parametrize("a", [1, 8])
def test_empty_experts_wgrad_accumulator_over_chunks(backend, dtype, a):
    """Empty experts through :class:`WgradAccumulator` (num_token_chunks): the experts' gradient summed
    over three chunks with the case's counts and NaN padding: dW[1], dW[4] exactly 0, the others
    the float64 sum of the chunks' references."""
    from dropless.ops.grouped_gemm import WgradAccumulator

    w = torch.randn(6, 64, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)
    w.requires_grad_(True)
    acc = WgradAccumulator(get_backend(backend))
    w_c = acc.collect(w, "w")
    want = torch.zeros(w.shape, dtype=torch.float64)
    total = 0
    for seed in (1, 2, 3):
        lay, x, _, seg, _, g = make(EMPTY_EXPERT_COUNTS, a, extra=5, dtype=dtype, seed=seed)
        dy = torch.randn(x.shape[0], 32, generator=g).to(dtype)
        total = total + (grouped_mm(x, w_c, lay, backend, wgrad=(acc, "w")) * dy).nan_to_num().sum()
        want += reference(x.nan_to_num(), w.detach(), seg, dy)[2]
    total.backward()
    assert (w.grad[1] == 0).all() and (w.grad[4] == 0).all()
    for i in (0, 2, 3, 5):
        assert_close_scaled(w.grad[i], want[i], TOL[dtype], f"dW[{i}]")


@pytest.mark.parametrize("counts,a", [([7, 0, 12], 1), ([19], 8), ([5, 9], 4)])
def test_torch_weight_gradient_takes_column_major_operands(counts, a):
    """``TorchBackend.gmm_wgrad`` on column-major ``x`` / ``dy`` (e.g. a transposed copy) equals the float64
    product on every path (one expert, ``A = 1``, gaps): the operands are made row-contiguous first."""
    seg = py_segments(counts, a)
    lay = ExpertLayout.from_counts(torch.tensor(counts), alignment=a, capacity=seg[-1][1] + 3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, lay.capacity, generator=g).t()   # [M, 32], unit stride along the rows
    dy = torch.randn(16, lay.capacity, generator=g).t()
    dw = get_backend("torch").gmm_wgrad(x, dy, lay)
    for i, (s, t) in enumerate(seg):
        ref = x[s:t].double().t() @ dy[s:t].double()
        assert torch.allclose(dw[i].double(), ref, rtol=1e-5, atol=1e-5)
