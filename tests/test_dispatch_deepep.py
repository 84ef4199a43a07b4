"""The pure-torch parts of the ``deepep`` dispatcher, on CPU, against plain-Python references.

* :func:`expand_received` (DeepEP V1 normal mode lands one row per (token, this rank),
  grouped by source rank, with local expert ids or -1): the landed rows, their
  :class:`ExpertLayout` and ``dest`` equal a Python loop that walks the received rows in
  order and appends each local choice to its expert's segment; the gradient of the
  received rows is the sum over their local choices. Also with no received row at all.
* :func:`reduce_to_received`: the weighted sum over each received row's local choices
  equals a float64 loop (it feeds DeepEP's unweighted combine).
* :func:`layout_from_v2_psum`: DeepEP V2's expanded-dispatch ``psum_num_recv_tokens_per_expert``
  (documented as ``psum[i] = align(psum[i-1], A) + count[i]``), built here by a loop, converts
  to the same layout as ``ExpertLayout.from_counts``; the example of docs/design.md#the-live-row-contract
  (A = 128, counts [96, 0, 129, 1] -> end [96, 128, 257, 385]).
* Without ``deep_ep``, configuring ``deepep`` raises a ConfigError that says how to install it.
The adapter class itself needs deep_ep and Hopper GPUs and cannot run here. Runtime < 2 s.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dropless.config import ConfigError, ModelArgs
from dropless.dispatch import build_dispatcher
from dropless.dispatch.deepep import (
    _combine_with_bias,
    expand_received,
    layout_from_v2_psum,
    reduce_to_received,
    v2_slots_to_dest,
)
from dropless.layout import ExpertLayout
from tests.conftest import py_layout

HAS_DEEP_EP = importlib.util.find_spec("deep_ep") is not None


def _received(n, k, e, seed, frac_local=0.6):
    """Random V1-style receive: k distinct local ids per row or -1 (each row has >= 1 local choice)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((n, k), -1, dtype=torch.int64)
    for t in range(n):
        perm = torch.randperm(e, generator=g)[:k]
        keep = torch.rand(k, generator=g) < frac_local
        keep[torch.randint(k, (1,), generator=g)] = True
        idx[t] = torch.where(keep, perm, torch.full_like(perm, -1))
    return idx


def _py_expand(idx, e, a):
    counts = [0] * e
    for row in idx.tolist():
        for x in row:
            if x >= 0:
                counts[x] += 1
    start, end = py_layout(counts, a)
    fill = list(start)
    dest = []
    for row in idx.tolist():
        d = []
        for x in row:
            if x >= 0:
                d.append(fill[x])
                fill[x] += 1
            else:
                d.append(-1)
        dest.append(d)
    return counts, start, end, dest


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 4), e=st.integers(4, 6), a=st.sampled_from([1, 4, 8, 128]),
       seed=st.integers(0, 10_000))
def test_expand_received_matches_loop(n, k, e, a, seed):
    idx = _received(n, k, e, seed)
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    rows, layout, dest = expand_received(x, idx, e, a)
    counts, start, end, pdest = _py_expand(idx, e, a)
    assert layout.counts.tolist() == counts and layout.start.tolist() == start and layout.end.tolist() == end
    assert layout.alignment == a and layout.capacity >= end[-1]
    assert dest.tolist() == pdest
    for t in range(n):
        for j in range(k):
            if pdest[t][j] >= 0:
                assert torch.equal(rows[pdest[t][j]], x[t])


def test_expand_received_gradient_sums_local_choices():
    idx = _received(12, 3, 4, seed=5)
    x = torch.randn(12, 8, dtype=torch.float64, requires_grad=True)
    rows, layout, dest = expand_received(x, idx, 4, 8)
    g = torch.randn_like(rows)
    (rows * g).sum().backward()
    want = torch.zeros_like(x)
    for t in range(12):
        for j in range(3):
            if dest[t, j] >= 0:
                want[t] += g[dest[t, j]]
    assert torch.allclose(x.grad, want, rtol=0, atol=1e-12)


def test_expand_received_with_no_rows():
    """A rank that received nothing: empty layout, forward and backward still run."""
    x = torch.zeros(0, 8, requires_grad=True)
    idx = torch.zeros(0, 2, dtype=torch.int64)
    rows, layout, dest = expand_received(x, idx, 4, 8)
    assert layout.counts.tolist() == [0, 0, 0, 0] and layout.end.tolist() == [0, 0, 0, 0]
    assert rows.shape == (layout.capacity, 8) and dest.shape == (0, 2)
    y = reduce_to_received(rows * 2.0, dest, torch.zeros(0, 2))
    assert y.shape == (0, 8)
    (rows.sum() * 0 + y.sum()).backward()
    assert x.grad.shape == (0, 8)


@pytest.mark.parametrize("weighted", [True, False])
def test_reduce_to_received_matches_float64_loop(weighted):
    n, k, e = 20, 3, 5
    idx = _received(n, k, e, seed=9)
    x = torch.randn(n, 8)
    rows, layout, dest = expand_received(x, idx, e, 8)
    y = torch.randn(layout.capacity, 8)
    layout.fill_padding_(y)  # padding is NaN: must not be read
    w = torch.rand(n, k) if weighted else None
    out = reduce_to_received(y, dest, w)
    want = torch.zeros(n, 8, dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            if dest[t, j] >= 0:
                want[t] += (w[t, j].double() if weighted else 1.0) * y[dest[t, j]].double()
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-6)


def _v2_psum_loop(counts, a):
    """DeepEP's documented expanded-mode psum: psum[i] = align(psum[i-1], A) + count[i], psum[-1] = 0."""
    out, prev = [], 0
    for i, c in enumerate(counts):
        base = 0 if i == 0 else -(-prev // a) * a
        prev = base + c
        out.append(prev)
    return out


@pytest.mark.parametrize("a", [1, 8, 128])
@pytest.mark.parametrize("seed", range(4))
def test_layout_from_v2_psum_equals_from_counts(a, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 300, (7,), generator=g)
    counts[torch.randint(7, (2,), generator=g)] = 0  # empty experts
    psum = torch.tensor(_v2_psum_loop(counts.tolist(), a), dtype=torch.int32)
    cap = int(psum[-1]) + 5
    got = layout_from_v2_psum(psum, a, cap)
    want = ExpertLayout.from_counts(counts, a, capacity=cap)
    for f in ("counts", "start", "end"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
        assert getattr(got, f).dtype == torch.int32
    assert (got.capacity, got.alignment) == (cap, a)


def test_layout_from_v2_psum_design_example():
    psum = torch.tensor(_v2_psum_loop([96, 0, 129, 1], 128))
    lay = layout_from_v2_psum(psum, 128, 512)
    assert lay.end.tolist() == [96, 128, 257, 385]
    assert lay.start.tolist() == [0, 128, 128, 384]
    assert lay.counts.tolist() == [96, 0, 129, 1]


def test_v2_slots_feed_reduce_to_received():
    """V2's per-token expanded slots (recv_src_metadata[:, 2:]) are our dest: the reverse works on them."""
    n, k, e, a = 10, 2, 3, 8
    idx = _received(n, k, e, seed=2)
    _, start, end, pdest = _py_expand(idx, e, a)
    slots = torch.tensor(pdest, dtype=torch.int32)            # as DeepEP would report them
    dest = v2_slots_to_dest(slots)
    assert dest.dtype == torch.int64 and dest.tolist() == pdest
    y = torch.randn(end[-1] + 3, 4)
    out = reduce_to_received(y, dest, None)
    for t in range(n):
        want = sum((y[d] for d in pdest[t] if d >= 0), torch.zeros(4))
        assert torch.allclose(out[t], want)


@pytest.mark.skipif(HAS_DEEP_EP, reason="deep_ep is installed")
def test_deepep_without_deep_ep_says_how_to_install():
    with pytest.raises(ConfigError) as ei:
        build_dispatcher("deepep", ModelArgs())
    msg = str(ei.value)
    assert "deep_ep" in msg and "setup.py install" in msg and "NVSHMEM" in msg and "Hopper" in msg


def test_combine_bias_joins_deep_eps_sum_or_is_added_after_with_a_warning():
    """The shared experts' output goes to DeepEP's combine as its ``bias`` (added before the one
    rounding); a DeepEP whose combine has no ``bias`` argument gets it added after, with a warning."""
    x = torch.randn(5, 8).to(torch.bfloat16)
    bias = torch.randn(5, 8).to(torch.bfloat16)
    seen = {}

    def with_bias(x, handle=None, topk_weights=None, bias=None):  # sums in fp32, rounds once
        seen["bias"] = bias
        return (x.float() + bias.float()).to(x.dtype), None, None

    def without_bias(x, handle=None, topk_weights=None):
        return x.clone(), None, None

    out = _combine_with_bias(with_bias, x, bias, handle="h")
    assert seen["bias"] is bias and torch.equal(out, (x.float() + bias.float()).to(torch.bfloat16))
    with pytest.warns(UserWarning, match="bias"):
        assert torch.equal(_combine_with_bias(without_bias, x, bias, handle="h"), out)
    assert torch.equal(_combine_with_bias(without_bias, x, None, handle="h"), x)
