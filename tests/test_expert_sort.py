"""The dispatch's live-row layout (:mod:`dropless.ops.expert_sort`): the Triton kernels against the torch
reference and a plain-Python stable sort.

The kernels run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is
imported). In a plain CPU run, :func:`test_kernel_cases_under_the_interpreter` runs this file again in a
subprocess with the interpreter on, so the kernels are always checked where triton is installed.
Everything is integer: the two paths must agree exactly.
"""

from __future__ import annotations

import pytest
import torch

from dropless.ops import expert_sort as es
from dropless.ops import select
from tests.conftest import rerun_under_interpreter
from tests.test_permute import py_sort

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
KERNEL_HERE = select.HAS_TRITON and (CUDA or select.interpreting())  # the kernels can run in this process
needs_kernel = pytest.mark.skipif(not KERNEL_HERE, reason="no CUDA and Triton's interpreter is off "
                                  "(test_kernel_cases_under_the_interpreter runs these in a subprocess)")


@pytest.fixture
def kernel_path(monkeypatch):
    """Under the interpreter: take the Triton path with CPU tensors."""
    if DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)


def _routing(n, k, e, seed, foreign=0.1, skew=False, device=DEV):
    """[n, k] expert ids, distinct per row when k <= e, with a share ``foreign`` of them not here
    (-1 or >= e, as another rank's experts or a capacity drop mark them)."""
    g = torch.Generator().manual_seed(seed)
    if skew:  # most rows to the first experts: one segment far longer than the block
        w = torch.tensor([2.0 ** -i for i in range(e)])
    else:
        w = torch.ones(e)
    if k <= e:
        idx = torch.multinomial(w.expand(n, e), k, replacement=False, generator=g) if n else \
            torch.empty(0, k, dtype=torch.int64)
    else:
        idx = torch.randint(0, e, (n, k), generator=g)
    away = torch.rand(n, k, generator=g) < foreign
    other = torch.where(torch.rand(n, k, generator=g) < 0.5, torch.full_like(idx, -1), idx + e)
    return torch.where(away, other, idx).to(device)


def _check(idx, e, a, capacity=None, num_rows=None):
    layout, dest, src = es.sort_by_expert(idx, e, a, capacity=capacity, num_rows=num_rows)
    want_layout, want_dest, want_src = es.sort_by_expert_torch(idx.cpu(), e, a, layout.capacity)
    assert layout.capacity == want_layout.capacity and layout.alignment == a
    for name in ("counts", "start", "end"):
        got = getattr(layout, name)
        assert got.dtype == torch.int32, name
        assert torch.equal(got.cpu(), getattr(want_layout, name).to(torch.int32)), name
    assert dest.dtype == torch.int64 and dest.shape == idx.shape
    assert torch.equal(dest.cpu(), want_dest)
    assert src.dtype == torch.int64 and torch.equal(src.cpu(), want_src)
    return layout, dest, src


@needs_kernel
@pytest.mark.parametrize("n,k,e,a", [
    (37, 3, 4, 8),        # a few blocks' worth of nothing: one partial block
    (1000, 6, 64, 128),   # recipe=h200_single's experts, many blocks, a partial last one
    (513, 8, 256, 128),   # DeepSeek-V3's 256 experts: 16-entry blocks
    (300, 2, 10, 1),      # e not a power of two, no alignment
    (200, 1, 1, 16),      # one expert
    (64, 4, 3, 1),        # k > e: repeated experts in a row keep their flat order
    (64, 2, 256, 8),      # the widest kernel: 256 experts, 16-entry blocks
    (0, 6, 64, 128),      # no rows
])
def test_kernel_equals_reference(kernel_path, n, k, e, a):
    _check(_routing(n, k, e, seed=n + e), e, a)


@needs_kernel
def test_kernel_no_choices(kernel_path):
    """k = 0 (or N = 0): an empty layout, every row padding, and no warning from the masked lanes."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layout, dest, src = _check(torch.empty(5, 0, dtype=torch.int64, device=DEV), 4, 8)
    assert layout.counts.tolist() == [0] * 4 and layout.end.tolist() == [0] * 4
    assert dest.shape == (5, 0) and (src == -1).all()


@needs_kernel
def test_kernel_equals_python_stable_sort(kernel_path):
    """The rule itself, not only the reference: a stable sort of the flat choices by expert."""
    idx = _routing(53, 3, 5, seed=3, foreign=0.2)
    layout, dest, _ = _check(idx, 5, 4)
    counts, start, end, want_dest = py_sort(idx.cpu().tolist(), 5, 4)
    assert layout.counts.tolist() == counts and layout.start.tolist() == start and layout.end.tolist() == end
    assert dest.tolist() == want_dest


@needs_kernel
def test_kernel_long_segments_and_int32_ids(kernel_path):
    """One expert's segment spans many blocks (the scan carries its offset); int32 ids are read as such."""
    idx = _routing(3000, 4, 16, seed=1, skew=True)
    _check(idx, 16, 128)
    _check(idx.to(torch.int32), 16, 128)
    _check(idx.t().contiguous().t(), 16, 8)  # a non-contiguous [N, k]


@needs_kernel
def test_kernel_capacity_bound_and_overflow(kernel_path):
    """A static M at the exact need passes; src past M is never written; one row short raises."""
    idx = torch.tensor([[0, 2], [2, 1], [0, 2]], device=DEV)
    layout, dest, src = _check(idx, 3, 4, capacity=11)
    assert layout.start.tolist() == [0, 4, 8] and layout.end.tolist() == [2, 5, 11]
    assert dest.tolist() == [[0, 8], [9, 4], [1, 10]]
    _check(idx, 3, 4, num_rows=5)  # a host bound on the rows routed here sets M
    if DEV == "cpu":  # a device-side assert would end the CUDA context of the test process
        with pytest.raises(RuntimeError, match="overflow"):
            es.sort_by_expert(idx, 3, alignment=4, capacity=10)


def test_bad_input_raises_before_any_launch():
    with pytest.raises(ValueError, match="2-D integer"):
        es.sort_by_expert(torch.zeros(4, 2), 3)
    with pytest.raises(ValueError, match="2-D integer"):
        es.sort_by_expert(torch.zeros(4, 2, dtype=torch.complex64), 3)
    with pytest.raises(ValueError, match="num_experts"):
        es.sort_by_expert(torch.zeros(4, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="capacity"):
        es.sort_by_expert(torch.zeros(4, 2, dtype=torch.int64), 3, capacity=-1)
    with pytest.raises(ValueError, match="2-D integer"):
        es.sort_by_expert(torch.zeros(4, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="alignment"):
        es.sort_by_expert(torch.zeros(4, 2, dtype=torch.int64), 3, alignment=0)


def test_reference_is_taken_off_the_kernel_path(monkeypatch):
    """CPU tensors without the interpreter, or more padded experts than the kernels take: the reference."""
    monkeypatch.setattr(select, "FORCE_TRITON", True)
    monkeypatch.setattr(es, "_sort_by_expert_triton", None)  # calling it would fail
    idx = _routing(40, 2, 257, seed=0, device="cpu")
    layout, dest, src = es.sort_by_expert(idx, 257, 8)
    want = es.sort_by_expert_torch(idx, 257, 8, layout.capacity)
    assert torch.equal(dest, want[1]) and torch.equal(src, want[2])


@pytest.mark.skipif(not select.HAS_TRITON or KERNEL_HERE, reason="triton missing, or the kernels run here")
def test_kernel_cases_under_the_interpreter():
    """This file again with ``TRITON_INTERPRET=1``: the kernel cases above run on the CPU."""
    rerun_under_interpreter(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not select.HAS_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("n,k,e", [(32768, 6, 64), (8192, 8, 256), (4096, 8, 32), (2048, 4, 200)])
def test_kernel_matches_reference_on_cuda(n, k, e):
    """recipe=h200_single's routing, DeepSeek-V3's, an EP rank's 32 local experts with foreign ids, and 200
    experts (256 padded)."""
    idx = _routing(n, k, e, seed=e, foreign=0.0 if e == 64 else 0.3, device="cuda")
    _check(idx, e, 128)
