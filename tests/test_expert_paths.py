"""GroupedExperts chooses its path once, from the backend and the memory/debug options.

Each option set maps to one path class (:mod:`dropless.expert_paths`); setting ``backend``
chooses again; inputs a path does not take (a row source, FP8 rows) are refused naming the
option they need; :meth:`GroupedExperts.ahead` gives a handle only for ``recompute_fc1``.
"""

import pytest
import torch

from dropless.dispatch.local import LocalDispatcher
from dropless.expert_paths import Fp8FusedPath, GemmPath, RecomputePath
from dropless.experts import GroupedExperts, RecomputeAhead
from dropless.layout import ExpertLayout
from dropless.ops.fp8_backend import Fp8Backend

H, I, E = 16, 8, 4


@pytest.mark.parametrize("opts,path,takes_fp8,gathers", [
    (dict(), GemmPath, False, False),
    (dict(poison=True), GemmPath, False, False),
    (dict(poison=True, recompute_fc1=True, recompute_gather=True), GemmPath, False, False),
    (dict(recompute_swiglu=True), RecomputePath, False, False),
    (dict(recompute_fc1=True), RecomputePath, False, False),
    (dict(recompute_gather=True), RecomputePath, False, True),
    (dict(fp8=True), Fp8FusedPath, True, False),
    (dict(fp8=True, recompute_fc1=True), RecomputePath, False, False),
    (dict(fp8=True, recompute_fc1=True, recompute_gather=True), RecomputePath, False, True),
    (dict(fp8=True, recompute_swiglu=True), Fp8FusedPath, True, False),
    (dict(fp8=True, recompute_gather=True), Fp8FusedPath, False, True),
    (dict(fp8=True, recompute_gather=True, recompute_swiglu=True), Fp8FusedPath, False, True),
    (dict(fp8=True, poison=True), GemmPath, False, False),
])
def test_the_path_follows_the_options(opts, path, takes_fp8, gathers):
    opts = dict(opts)
    gemm = Fp8Backend(emulate=True) if opts.pop("fp8", False) else "torch"
    ex = GroupedExperts(H, I, E, gemm=gemm, **opts)
    assert type(ex.path) is path
    assert (ex.takes_fp8_rows, ex.gathers) == (takes_fp8, gathers)
    if path is GemmPath:
        assert ex.path.poison == opts.get("poison", False)


def test_setting_the_backend_chooses_the_path_again():
    ex = GroupedExperts(H, I, E)
    assert type(ex.path) is GemmPath
    ex.backend = Fp8Backend(emulate=True)
    assert type(ex.path) is Fp8FusedPath and ex.path.backend is ex.backend
    assert ex.takes_fp8_rows


def _source_and_layout():
    x = torch.randn(6, H)
    d = LocalDispatcher(E).dispatch_source(x, torch.tensor([[0, 1]] * 3 + [[2, 3]] * 3), torch.ones(6, 2))
    return d


def test_a_row_source_needs_recompute_gather():
    d = _source_and_layout()
    with pytest.raises(ValueError, match="recompute_gather"):
        GroupedExperts(H, I, E)(None, d.layout, source=d.source)
    ex = GroupedExperts(H, I, E, recompute_gather=True)
    ex.init_weights(0, 0)
    assert ex(None, d.layout, source=d.source).shape == (d.layout.capacity, H)


@pytest.mark.parametrize("opts,has_ahead", [(dict(recompute_fc1=True), True), (dict(recompute_swiglu=True), False),
                                            (dict(), False)])
def test_ahead_only_for_recompute_fc1_with_a_graph(opts, has_ahead):
    ex = GroupedExperts(H, I, E, **opts)
    ex.init_weights(0, 0)
    lay = ExpertLayout.from_counts(torch.tensor([2, 0, 3, 1]), 1, capacity=6)
    y = ex(torch.randn(6, H), lay)
    assert isinstance(ex.ahead(y), RecomputeAhead) is has_ahead
    with torch.no_grad():
        assert ex.ahead(ex(torch.randn(6, H), lay)) is None
