"""Tests of dropless.permute: sort_by_expert, permute_rows, combine_rows (docs/design.md#memory).

References: a plain-Python stable sort of the (token, choice) pairs by expert, and
float64 loops for the gather / weighted sum and their gradients;
``torch.autograd.gradcheck`` in float64 on the live rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dropless.permute import combine_rows, gather_sum, permute_rows, sort_by_expert
from tests.conftest import py_layout
from tests.once_rounded import near_cancelling

NAN = float("nan")


# ----------------------------------------------------------------- references
def py_sort(idx: list[list[int]], e: int, a: int):
    """Stable sort of the choices by expert in (token, choice) order; choices outside [0, e) dropped."""
    counts = [0] * e
    for row in idx:
        for ex in row:
            if 0 <= ex < e:
                counts[ex] += 1
    start, _ = py_layout(counts, a)
    seen = [0] * e
    dest = []
    for row in idx:
        drow = []
        for ex in row:
            if 0 <= ex < e:
                drow.append(start[ex] + seen[ex])
                seen[ex] += 1
            else:
                drow.append(-1)
        dest.append(drow)
    end = [s + c for s, c in zip(start, counts)]
    return counts, start, end, dest


def setup(n=7, k=3, e=4, a=8, seed=0, dtype=torch.float64, h=5, foreign=True, capacity=None):
    """Random routing with some choices routed elsewhere (index -1 or >= e)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, e, (n, k), generator=g)
    if foreign:
        idx[0, 1] = -1
        idx[n - 1, 0] = e + 2
    layout, dest, src = sort_by_expert(idx, e, a, capacity=capacity)
    live = layout.live_mask()
    x = torch.randn(n, h, dtype=dtype, generator=g)
    return idx, layout, dest, src, live, x, g


def ref_gather_sum(rows, dest, w=None):
    """float64 loop: out[n] = sum_j w[n, j] rows[dest[n, j]] (dest < 0: nothing)."""
    n, k = dest.shape
    out = torch.zeros(n, rows.shape[1], dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            d = int(dest[t, j])
            if d >= 0:
                out[t] += (1.0 if w is None else float(w[t, j])) * rows[d].double()
    return out


# ----------------------------------------------------------------- sort_by_expert
@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(0, 25), k=st.integers(1, 4), e=st.integers(1, 6),
       a=st.sampled_from([1, 2, 8, 128]))
def test_sort_by_expert_matches_python_stable_sort(data, n, k, e, a):
    idx = data.draw(st.lists(st.lists(st.integers(-2, e + 1), min_size=k, max_size=k), min_size=n, max_size=n))
    idx_t = torch.tensor(idx, dtype=torch.int64).view(n, k)
    layout, dest, src = sort_by_expert(idx_t, e, a)
    counts, start, end, want_dest = py_sort(idx, e, a)
    assert layout.counts.tolist() == counts
    assert layout.start.tolist() == start and layout.end.tolist() == end
    assert dest.dtype == torch.int64 and dest.shape == (n, k)
    assert dest.tolist() == (want_dest if n else [])
    want_src = [-1] * layout.capacity
    for t, row in enumerate(want_dest):
        for d in row:
            if d >= 0:
                want_src[d] = t
    assert src.tolist() == want_src
    # dest and src are inverse on the live rows
    for t, row in enumerate(want_dest):
        for d in row:
            if d >= 0:
                assert int(src[d]) == t
    assert layout.capacity >= (end[-1] if end else 0)


def test_sort_by_expert_static_capacity_and_overflow():
    idx = torch.tensor([[0, 2], [2, 1], [0, 2]])
    layout, dest, src = sort_by_expert(idx, 3, alignment=4, capacity=32)
    assert layout.capacity == 32 and src.shape == (32,)
    assert layout.start.tolist() == [0, 4, 8] and layout.end.tolist() == [2, 5, 11]
    assert dest.tolist() == [[0, 8], [9, 4], [1, 10]]
    with pytest.raises(RuntimeError, match="overflow"):
        sort_by_expert(idx, 3, alignment=4, capacity=10)   # needs 11 rows


# ----------------------------------------------------------------- permute_rows
@pytest.mark.parametrize("a", [1, 8, 128])
def test_permute_rows_forward_and_grad(a):
    idx, layout, dest, src, live, x, g = setup(a=a)
    x.requires_grad_(True)
    rows = permute_rows(x, src, dest)
    assert rows.shape == (layout.capacity, x.shape[1]) and rows.dtype == x.dtype
    live_idx = live.nonzero().squeeze(1)
    assert torch.equal(rows[live_idx], x.detach()[src[live_idx]])
    # upstream gradient with NaN in every padding row: it must not reach grad_x
    grad = torch.randn(rows.shape, dtype=torch.float64, generator=g)
    grad[~live] = NAN
    (gx,) = torch.autograd.grad(rows, x, grad)
    assert torch.isfinite(gx).all()
    torch.testing.assert_close(gx, ref_gather_sum(grad, dest), rtol=0, atol=1e-14)
    # gradcheck on the live rows (padding rows of the output are unspecified by contract)
    assert torch.autograd.gradcheck(lambda x_: permute_rows(x_, src, dest)[live_idx], (x,))


def test_permute_rows_bf16_grad_accumulates_in_fp32():
    """grad_x[n] = sum over k of bf16 rows, accumulated in fp32 and rounded once."""
    idx, layout, dest, src, live, x, g = setup(n=9, k=4, e=3, a=1, foreign=False)
    xb = x.bfloat16().requires_grad_(True)
    rows = permute_rows(xb, src, dest)
    grad = torch.randn(rows.shape, generator=g).bfloat16()
    (gx,) = torch.autograd.grad(rows, xb, grad)
    acc = torch.zeros(9, x.shape[1])
    for j in range(4):
        acc += grad.float()[dest[:, j]]
    assert gx.dtype == torch.bfloat16
    assert torch.equal(gx, acc.bfloat16())


# ----------------------------------------------------------------- combine_rows
@pytest.mark.parametrize("a", [1, 8, 128])
@pytest.mark.parametrize("weighted", [True, False])
def test_combine_rows_forward_and_grad(a, weighted):
    idx, layout, dest, src, live, _, g = setup(a=a)
    m, h = layout.capacity, 5
    y = torch.randn(m, h, dtype=torch.float64, generator=g)
    y[~live] = NAN                       # padding rows hold garbage
    y.requires_grad_(True)
    w = (torch.rand(dest.shape, dtype=torch.float64, generator=g) + 0.1).requires_grad_(weighted)
    out = combine_rows(y, dest, w if weighted else None)
    assert out.dtype == torch.float64 and out.shape == (dest.shape[0], h)
    assert torch.isfinite(out).all()
    want = ref_gather_sum(y.detach(), dest, w.detach() if weighted else None)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-14)

    gout = torch.randn(out.shape, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad(out, (y, w) if weighted else (y,), gout)
    gy = grads[0]
    live_idx = live.nonzero().squeeze(1)
    assert torch.isfinite(gy[live_idx]).all()
    want_gy = torch.zeros(m, h, dtype=torch.float64)
    for t in range(dest.shape[0]):
        for j in range(dest.shape[1]):
            d = int(dest[t, j])
            if d >= 0:
                want_gy[d] = gout[t] * (float(w.detach()[t, j]) if weighted else 1.0)
    torch.testing.assert_close(gy[live_idx], want_gy[live_idx], rtol=0, atol=1e-14)
    if weighted:
        gw = grads[1]
        assert torch.isfinite(gw).all()   # NaN padding rows of y never enter the weight gradient
        want_gw = torch.zeros(dest.shape, dtype=torch.float64)
        for t in range(dest.shape[0]):
            for j in range(dest.shape[1]):
                d = int(dest[t, j])
                if d >= 0:
                    want_gw[t, j] = (gout[t] * y.detach()[d]).sum()
        torch.testing.assert_close(gw, want_gw, rtol=0, atol=1e-13)
        assert gw[0, 1] == 0 and gw[-1, 0] == 0   # the choices routed elsewhere


@pytest.mark.parametrize("weighted", [True, False])
def test_combine_rows_gradcheck_fp64(weighted):
    idx, layout, dest, src, live, _, g = setup(a=8)
    live_idx = live.nonzero().squeeze(1)
    y_live = torch.randn(live_idx.numel(), 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(dest.shape, dtype=torch.float64, generator=g, requires_grad=True)

    def f(y_l, *ws):
        buf = torch.full((layout.capacity, 4), NAN, dtype=torch.float64).index_put((live_idx,), y_l)
        return combine_rows(buf, dest, ws[0] if ws else None)

    assert torch.autograd.gradcheck(f, (y_live, w) if weighted else (y_live,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_rows_fp32_accumulate_fixed_order(dtype):
    """The weighted sum over k is accumulated in fp32 in the order j = 0..k-1 and rounded once."""
    idx, layout, dest, src, live, _, g = setup(n=11, k=4, e=3, a=8, foreign=False)
    y = torch.randn(layout.capacity, 16, generator=g).to(dtype)
    w = torch.rand(dest.shape, generator=g)
    out = combine_rows(y, dest, w)
    acc = torch.zeros(11, 16)
    for j in range(4):
        acc = acc + y.float()[dest[:, j]] * w[:, j:j + 1]
    assert out.dtype == dtype
    assert torch.equal(out, acc.to(dtype))
    # and close to the float64 sum
    torch.testing.assert_close(out.double(), ref_gather_sum(y, dest, w.double()),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("addend_at", ["all", "slice"])
def test_combine_rows_adds_the_addend_before_its_one_rounding(weighted, addend_at):
    """routed + shared, nearly cancelling, in bf16: the float64 sum rounded once, bit for bit.

    Rounding the routed sum to bf16 before adding the addend (two roundings) misses by up to
    hundreds of ulp here. ``slice``: the addend covers rows 9 … 20 only (an agrs rank's own tokens).
    """
    n, k = 29, 3
    row0, rows_a = (0, None) if addend_at == "all" else (9, 12)
    y, dest, w, addend, want = near_cancelling(n, k, 120, 64, seed=3, weighted=weighted, addend_rows=rows_a,
                                               addend_row0=row0)
    out = combine_rows(y, dest, w, addend, row0)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want)
    twice = combine_rows(y, dest, w).float()
    twice[row0:row0 + addend.shape[0]] += addend.float()
    assert not torch.equal(twice.to(torch.bfloat16), want)  # the inputs do tell one rounding from two
    # backward: the addend's gradient is the output's on its rows; the rest is the routed combine's
    yl, wl, al = y.clone().requires_grad_(), (w.clone().requires_grad_() if weighted else None), \
        addend.clone().requires_grad_()
    gout = torch.randn(n, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    combine_rows(yl.nan_to_num(), dest, wl, al, row0).backward(gout)
    assert torch.equal(al.grad, gout[row0:row0 + addend.shape[0]])
    yr, wr = y.clone().nan_to_num().requires_grad_(), (w.clone().requires_grad_() if weighted else None)
    combine_rows(yr, dest, wr).backward(gout)
    used = dest[dest >= 0]  # padding rows of the rows' gradient are unwritten by contract
    assert torch.equal(yl.grad[used], yr.grad[used])
    if weighted:
        assert torch.equal(wl.grad, wr.grad)


def test_combine_rows_addend_gradcheck_fp64():
    idx, layout, dest, src, live, _, g = setup(a=8)
    live_idx = live.nonzero().squeeze(1)
    y_live = torch.randn(live_idx.numel(), 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.rand(dest.shape, dtype=torch.float64, generator=g, requires_grad=True)
    a = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)

    def f(y_l, w, a):
        buf = torch.full((layout.capacity, 4), NAN, dtype=torch.float64).index_put((live_idx,), y_l)
        return combine_rows(buf, dest, w, a, 2)

    assert torch.autograd.gradcheck(f, (y_live, w, a))


def test_combine_rows_bad_addend_names_it():
    y, dest, w, addend, _ = near_cancelling(6, 2, 20, 8, seed=0)
    for bad, row0 in ((addend[:, :4], 0), (addend, 1), (addend, -1)):
        with pytest.raises(ValueError, match="addend"):
            combine_rows(y, dest, w, bad, row0)


def test_permute_then_combine_round_trip():
    """combine(permute(x)) without weights = (number of local choices) * x, with NaN padding."""
    idx, layout, dest, src, live, x, g = setup(a=128)
    rows = permute_rows(x, src, dest).clone()
    rows[~live] = NAN
    out = combine_rows(rows, dest)
    n_here = (dest >= 0).sum(1, keepdim=True).double()
    torch.testing.assert_close(out, n_here * x, rtol=0, atol=1e-14)
    assert torch.equal(gather_sum(rows, dest, None), out)


# ----------------------------------------------------------------- saved tensors (memory)
class SavedLog:
    """Records every tensor autograd saves for backward inside the context."""

    def __init__(self):
        self.saved: list[torch.Tensor] = []

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def _pack(self, t):
        self.saved.append(t)
        return t

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.data_ptr() == b.data_ptr())


def test_permute_rows_saves_only_integer_indices():
    idx, layout, dest, src, live, x, g = setup(a=8)
    x = x.float().requires_grad_(True)
    with SavedLog() as log:
        rows = permute_rows(x, src, dest)
    assert log.saved, "permute_rows saved nothing: the hook did not see the Function"
    assert all(not t.is_floating_point() for t in log.saved), [t.dtype for t in log.saved]
    assert len(log.saved) == 1 and same(log.saved[0], dest)
    # the backward still works from the indices alone
    rows.sum().backward()
    assert torch.equal(x.grad, (dest >= 0).sum(1, keepdim=True).float().expand_as(x))


def test_combine_rows_saved_tensors():
    idx, layout, dest, src, live, _, g = setup(a=8)
    y = torch.randn(layout.capacity, 5, generator=g, requires_grad=True)
    with SavedLog() as log:
        combine_rows(y, dest)
    assert len(log.saved) == 1 and same(log.saved[0], dest) and not log.saved[0].is_floating_point()

    w = torch.rand(dest.shape, generator=g, requires_grad=True)
    with SavedLog() as log:
        out = combine_rows(y, dest, w)
    # with weights: exactly the indices, the weights and y (for the weight gradient)
    assert len(log.saved) == 3
    assert same(log.saved[0], dest) and same(log.saved[1], w) and same(log.saved[2], y)
    out.sum().backward()
    assert w.grad is not None and y.grad is not None
