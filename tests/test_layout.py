"""Tests of dropless.layout: the live-row ExpertLayout (docs/design.md#the-live-row-contract).

References are plain-Python recurrences of the rules of docs/design.md#the-live-row-contract::

    start[0] = 0;  start[e] = align_up(end[e-1], A);  end[e] = start[e] + counts[e]

plus the example of docs/design.md#the-live-row-contract and the numbers of docs/design.md#a-worked-rank.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dropless.layout import ExpertLayout, align_up, aligned_capacity, poison_padding
from tests.conftest import py_layout

ALIGNMENTS = st.sampled_from([1, 2, 3, 8, 16, 64, 100, 128])
COUNTS = st.lists(st.one_of(st.just(0), st.integers(0, 300)), min_size=1, max_size=12)


# ----------------------------------------------------------------- references
def py_row_expert(counts: list[int], a: int, m: int) -> list[int]:
    start, end = py_layout(counts, a)
    owner = [-1] * m
    for e, (s, t) in enumerate(zip(start, end)):
        for r in range(s, t):
            owner[r] = e
    return owner


# ----------------------------------------------------------------- the example
def test_design_example():
    counts = torch.tensor([96, 0, 129, 1])
    lay = ExpertLayout.from_counts(counts, alignment=128, capacity=512)
    assert lay.start.tolist() == [0, 128, 128, 384]
    assert lay.end.tolist() == [96, 128, 257, 385]
    assert lay.counts.tolist() == [96, 0, 129, 1]
    for t in (lay.counts, lay.start, lay.end):
        assert t.dtype == torch.int32 and t.device == counts.device
    assert lay.capacity == 512 and lay.alignment == 128 and lay.num_experts == 4
    assert int(lay.total_rows()) == 385
    # the empty expert has start == end
    assert int(lay.start[1]) == int(lay.end[1])
    # rows: [0,96) expert 0, [96,128) gap, [128,257) expert 2, [257,384) gap, 384 expert 3, tail
    re = lay.row_expert().tolist()
    assert re == [0] * 96 + [-1] * 32 + [2] * 129 + [-1] * 127 + [3] + [-1] * 127
    assert lay.live_mask().sum().item() == 226


def test_seed_numbers_per_rank():
    """docs/design.md#a-worked-rank: counts [21733, 15004, 17982, 10817] align (A = 128) to 65,792 rows (+0.39 %)."""
    counts = [21733, 15004, 17982, 10817]
    lay = ExpertLayout.from_counts(torch.tensor(counts), alignment=128, num_rows=sum(counts))
    start, end = py_layout(counts, 128)
    assert lay.start.tolist() == start and lay.end.tolist() == end
    assert sum(counts) == 65536
    assert align_up(int(lay.total_rows()), 128) == 65792
    assert round(100 * (65792 / 65536 - 1), 2) == 0.39
    # the bound on the alignment overhead: (e-1)(A-1) rows
    assert lay.capacity == aligned_capacity(65536, 4, 128) == 65536 + 3 * 127
    assert int(lay.total_rows()) <= lay.capacity


# ----------------------------------------------------------------- property tests
@settings(max_examples=300, deadline=None)
@given(counts=COUNTS, a=ALIGNMENTS, extra=st.integers(0, 50))
def test_from_counts_matches_recurrence(counts, a, extra):
    r = sum(counts)
    lay = ExpertLayout.from_counts(torch.tensor(counts, dtype=torch.int64), alignment=a, num_rows=r + extra)
    start, end = py_layout(counts, a)
    assert lay.start.tolist() == start
    assert lay.end.tolist() == end
    assert lay.counts.tolist() == counts
    assert all(s % a == 0 for s in start)
    assert lay.start.dtype == lay.end.dtype == lay.counts.dtype == torch.int32
    # default capacity is the static bound for num_rows rows; it always holds the live rows
    assert lay.capacity == (r + extra) + (len(counts) - 1) * (a - 1)
    assert end[-1] <= lay.capacity


@settings(max_examples=200, deadline=None)
@given(counts=COUNTS, a=ALIGNMENTS, extra=st.integers(0, 40))
def test_row_expert_and_live_mask_match_python(counts, a, extra):
    _, end = py_layout(counts, a)
    m = end[-1] + extra
    lay = ExpertLayout.from_counts(torch.tensor(counts), alignment=a, capacity=m)
    want = py_row_expert(counts, a, m)
    assert lay.row_expert().tolist() == want
    assert lay.live_mask().tolist() == [o >= 0 for o in want]
    assert int(lay.live_mask().sum()) == sum(counts)


def test_no_expert_every_row_is_padding():
    lay = ExpertLayout.from_counts(torch.tensor([], dtype=torch.int64), alignment=1, num_rows=5)
    assert lay.row_expert().tolist() == [-1] * lay.capacity and not lay.live_mask().any()


@settings(max_examples=200, deadline=None)
@given(e=st.integers(1, 10), a=ALIGNMENTS, r=st.integers(0, 500))
def test_aligned_capacity_is_a_tight_bound(e, a, r):
    bound = aligned_capacity(r, e, a)
    assert bound == r + (e - 1) * (a - 1)
    if r >= e - 1:
        # the worst case: every expert but the last holds a multiple of A plus one row
        counts = [1] * (e - 1) + [r - (e - 1)]
        _, end = py_layout(counts, a)
        assert end[-1] == bound
        lay = ExpertLayout.from_counts(torch.tensor(counts), alignment=a, num_rows=r)
        assert int(lay.total_rows()) == bound == lay.capacity


# ----------------------------------------------------------------- tiles (docs/design.md#failure-classes)
def check_tiles(counts: list[int], a: int, block_m: int, capacity: int | None = None):
    start, end = py_layout(counts, a)
    m = capacity if capacity is not None else end[-1]
    lay = ExpertLayout.from_counts(torch.tensor(counts), alignment=a, capacity=m)
    tile_expert, tile_row, n_tiles = lay.tiles(block_m)
    assert tile_expert.shape == tile_row.shape == (n_tiles,)
    covered = []
    used = 0
    for ex, row in zip(tile_expert.tolist(), tile_row.tolist()):
        if ex < 0:
            continue
        used += 1
        # a tile starts inside its own expert's live rows and is clipped at that expert's end
        assert start[ex] <= row < end[ex], (ex, row)
        assert (row - start[ex]) % block_m == 0
        covered.extend(range(row, min(row + block_m, end[ex])))
    # the tiles cover exactly the live rows, each once
    live = [r for e, (s, t) in enumerate(zip(start, end)) for r in range(s, t)]
    assert sorted(covered) == live
    assert len(covered) == len(set(covered))
    assert used == sum(-(-c // block_m) for c in counts) <= n_tiles
    return tile_expert, tile_row


def test_tiles_never_mix_experts():
    """No tile spans two experts (docs/design.md#failure-classes): rows [128, 130, 65], A = 64, tiles of 128."""
    counts = [128, 130, 65]
    start, end = py_layout(counts, 64)
    assert start == [0, 128, 320] and end == [128, 258, 385]
    tile_expert, tile_row = check_tiles(counts, 64, 128)
    valid = tile_expert >= 0
    assert list(zip(tile_expert[valid].tolist(), tile_row[valid].tolist())) == [
        (0, 0), (1, 128), (1, 256), (2, 320)]
    # a naive tiling by 128 from row 0 would put rows 256..257 (expert 1) and 320..383
    # (expert 2) in the tile starting at 256 -- the fault of that class
    owner = py_row_expert(counts, 64, 385)
    assert {owner[r] for r in range(256, 385)} - {-1} == {1, 2}


@settings(max_examples=150, deadline=None)
@given(counts=COUNTS, a=ALIGNMENTS, block_m=st.sampled_from([1, 16, 64, 128, 96]), extra=st.integers(0, 300))
def test_tiles_property(counts, a, block_m, extra):
    _, end = py_layout(counts, a)
    check_tiles(counts, a, block_m, capacity=end[-1] + extra)


def test_tiles_seed_counts():
    counts = [21733, 15004, 17982, 10817]
    tile_expert, _ = check_tiles(counts, 128, 128)
    assert int((tile_expert >= 0).sum()) == sum(math.ceil(c / 128) for c in counts)


# ----------------------------------------------------------------- capacity and errors
def test_check_capacity_raises_on_overflow():
    counts = torch.tensor([96, 0, 129, 1])
    ExpertLayout.from_counts(counts, alignment=128, capacity=385).check_capacity()  # exact fit
    with pytest.raises(RuntimeError, match="overflow the buffer capacity M"):
        ExpertLayout.from_counts(counts, alignment=128, capacity=384).check_capacity()
    with pytest.raises(RuntimeError, match="overflow"):
        # A = 1 needs 226 rows
        ExpertLayout.from_counts(counts, alignment=1, capacity=225).check_capacity()
    ExpertLayout.from_counts(counts, alignment=1, capacity=226).check_capacity()


@pytest.mark.parametrize("bad, match", [
    (dict(counts_e=torch.tensor([1.0, 2.0])), "integer"),
    (dict(counts_e=torch.tensor([[1, 2]])), "1-D"),
    (dict(counts_e=torch.tensor([True, False])), "integer"),
    (dict(counts_e=torch.tensor([1, 2]), alignment=0), "expert_alignment"),
    (dict(counts_e=torch.tensor([1, 2]), alignment=8), "capacity"),
])
def test_from_counts_errors(bad, match):
    kw = dict(bad)
    if "capacity" not in kw and match != "capacity":
        kw["capacity"] = 16
    with pytest.raises(ValueError, match=match):
        ExpertLayout.from_counts(**kw)


def test_aligned_capacity_errors():
    for args in ((-1, 4, 8), (10, 0, 8), (10, 4, 0)):
        with pytest.raises(ValueError, match="aligned_capacity"):
            aligned_capacity(*args)


def test_layout_on_meta_device_needs_no_host_values():
    """Rule 1: the layout is computed on the device -- a meta tensor (no data) is enough."""
    counts = torch.empty(4, dtype=torch.int64, device="meta")
    lay = ExpertLayout.from_counts(counts, alignment=128, capacity=1024)
    assert lay.start.device.type == "meta" and lay.end.shape == (4,)
    assert lay.row_expert().shape == (1024,)
    tile_expert, tile_row, n = lay.tiles(128)
    assert tile_expert.shape == (n,) and n == 8 + 4


# ----------------------------------------------------------------- padding poison
def test_fill_padding_and_poison_padding():
    counts = [3, 0, 5, 2]
    lay = ExpertLayout.from_counts(torch.tensor(counts), alignment=4, capacity=20)
    owner = py_row_expert(counts, 4, 20)
    live = torch.tensor([o >= 0 for o in owner])
    x = torch.randn(20, 6, dtype=torch.float64, requires_grad=True)
    y = poison_padding(x, lay)
    assert torch.isnan(y[~live]).all()
    assert torch.equal(y[live], x[live])
    g = torch.randn(20, 6, dtype=torch.float64)
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.isnan(gx[~live]).all()          # the gradient's padding is poisoned too
    assert torch.equal(gx[live], g[live])
    buf = torch.zeros(20, 2, 3)
    lay.fill_padding_(buf, -7.0)
    assert (buf[~live] == -7.0).all() and (buf[live] == 0).all()
