"""Everything to one expert (docs/design.md#failure-classes): 4096 tokens on one rank of an EP group.

Two gloo ranks, top-1 over 8 experts (4 per rank), a selection bias that sends every token to
expert 0 on rank 0. Rank 0 must land all 4096 rows, rank 1 none, nothing is dropped, and every
rank's output and input gradient, and expert 0's weight gradient, equal the single-process
``local`` layer on the same 4096 tokens (fp32, max error ≤ 1e-5 of the largest value).
"""

from __future__ import annotations

import pytest

from tests import dist_harness as H
from tests.conftest import assert_scaled

pytestmark = pytest.mark.slow


def _local():
    from dropless.moe import MoE

    moe = MoE(H.one_expert_args(), H.LAYER_ID)
    moe.init_weights()
    H.one_expert_prepare(moe)
    x, cot = H.one_expert_batch()
    x = x.clone().requires_grad_()
    y = moe(x)
    assert int(moe.last_stats["rows_live"]) == H.ONE_EXPERT_TOKENS
    (y * cot).sum().backward()
    return y.detach(), x.grad, moe.experts.w13.grad


@pytest.mark.parametrize("name", ["a2a", "agrs"])
def test_all_tokens_to_one_expert_on_one_rank(name):
    world = 2
    res = H.run_world("one_expert_worker", world, name, deadline_s=180)
    y_ref, gx_ref, gw_ref = _local()
    assert [r["rows_live"] for r in res] == [H.ONE_EXPERT_TOKENS, 0]
    assert all(r["rows_dropped"] == 0 for r in res)
    half = H.ONE_EXPERT_TOKENS // world
    for rank, r in enumerate(res):
        sl = slice(rank * half, (rank + 1) * half)
        assert_scaled(r["y"], y_ref[sl], 1e-5)
        assert_scaled(r["x_grad"], gx_ref[sl], 1e-5)
    assert_scaled(res[0]["w13_grad"], gw_ref, 1e-5)
    assert (gw_ref[1:] == 0).all()  # the other experts got no row: exact zero gradient
