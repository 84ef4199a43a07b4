"""a2a, agrs and fsdp on 2 and 4 gloo ranks equal the single-process ``local`` MoE layer.

Each rank runs ``dropless.moe.MoE`` with the dispatcher on its slice of one global batch
(seed-fixed, rank r owns sequences r·B … r·B+B-1) and backpropagates ``Σ y·G`` with a
seed-fixed cotangent G; the test computes ``local`` on the whole global batch in this process.
Compared (fp32, max error ≤ 1e-5 of the largest reference value): the output and ``dx`` of
every rank's slice, and the gradients of the router weight and the shared expert (summed
over ranks), and of ``w13``/``w2`` (EP shards all-gathered; for fsdp the FSDP2 gradient,
which averages over dp, × world size). The expert weights themselves must be bit-equal to
``local``'s (the init draws each expert from its global id). Shapes: H=16, I=8, E=8, k=2,
n_group=4, topk_group=2, one shared expert, T=12 tokens per rank, aux loss off (its
per-rank sequence mean is a router matter, not a dispatcher one).

Scenarios: alignment A ∈ {1, 8}, weights folded or not, ``num_token_chunks = 3`` (the MoE
layer's two-phase dispatch/combine with several chunks in flight; also with recompute_fc1, folded
weights and, for fsdp, recompute_gather on top), and a router biased so that every
token picks rank 0's experts — the other ranks land no row at all and must still run
forward and backward (no hang) with equal values. The byte counters are checked against
the formulas of docs/design.md#dispatchers. Runtime: one 2-rank and one 4-rank spawn for the module, ≈ 25 s.
"""

from __future__ import annotations

import pytest
import torch

from tests import dist_harness as H
from tests.conftest import assert_scaled

pytestmark = pytest.mark.slow
TOL = 1e-5

SCENARIOS = [
    dict(name=f"{d}-A{a}-{'fold' if f else 'nofold'}{'-rank0only' if b else ''}", dispatcher=d, alignment=a,
         fold=f, biased=b)
    for d in ("a2a", "agrs", "fsdp")
    for (a, f, b) in ((1, False, False), (8, True, False), (8, False, True))
] + [
    # num_token_chunks = 3: the next chunk's dispatch is in flight while this chunk's experts run
    dict(name=f"{d}-A8-nofold-3chunks", dispatcher=d, alignment=8, fold=False, biased=False, chunks=3)
    for d in ("a2a", "agrs")
] + [
    # issue 6's memory options on top: chunk weight gradients summed in one buffer, FC1 recomputed,
    # and for fsdp (a local gather) the landed rows re-gathered in backward
    dict(name=f"{d}-A8-fold-3chunks-recompute", dispatcher=d, alignment=8, fold=True, biased=False, chunks=3,
         opts=dict(recompute_fc1=True, recompute_gather=d == "fsdp"))
    for d in ("a2a", "agrs", "fsdp")
]
# a mutation run: agrs with the all-gather's backward returning only this rank's own slice
# (the bug the issue names); the equivalence check must catch it
MUTANT = dict(name="agrs-mutant-local-only-dx", dispatcher="agrs", alignment=1, fold=False, biased=False,
              mutate_ag_backward=True)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world_results(request):
    world = request.param
    res = H.run_world("layer_worker", world, SCENARIOS + [MUTANT], deadline_s=180)
    return world, res


def _ref(world, sc):
    args = H.model_args(expert_alignment=sc["alignment"], fold_routing_weights=sc["fold"])  # local, 1 chunk
    return H.reference(world, args, sc["biased"])


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_layer_equals_local(world_results, sc):
    world, res = world_results
    ref = _ref(world, sc)
    scale = world if sc["dispatcher"] == "fsdp" else 1  # FSDP2 averages the expert grads over dp
    for r in range(world):
        got = res[r][sc["name"]]
        sl = slice(r * H.SEQS_PER_RANK, (r + 1) * H.SEQS_PER_RANK)
        where = f"{sc['name']} world={world} rank={r}"
        # same seed -> same global expert weights, whatever the layout
        assert torch.equal(got["w13"], ref["w13"]) and torch.equal(got["w2"], ref["w2"]), where
        assert_scaled(got["y"], ref["y"][sl], TOL, f"{where} y")
        assert_scaled(got["x_grad"], ref["x_grad"][sl], TOL, f"{where} dx")
        assert_scaled(got["router_grad"], ref["router_grad"], TOL, f"{where} d router.weight")
        assert_scaled(got["w13_grad"] * scale, ref["w13_grad"], TOL, f"{where} d w13")
        assert_scaled(got["w2_grad"] * scale, ref["w2_grad"], TOL, f"{where} d w2")
        for name, a, b in zip(("w1", "w3", "w2"), got["shared_grads"], ref["shared_grads"]):
            assert_scaled(a, b, TOL, f"{where} d shared.{name}")
    if sc["dispatcher"] == "fsdp":  # the experts really are sharded: each rank stores E/world of them
        assert all(res[r][sc["name"]]["w13_local_rows"] == 8 // world for r in range(world))


@pytest.mark.parametrize("name", ["a2a", "agrs"])
def test_rank_with_no_rows_completes(world_results, name):
    """Every token routed to rank 0's experts: the other ranks land 0 rows, yet finish with equal values."""
    world, res = world_results
    key = f"{name}-A8-nofold-rank0only"
    t_k = H.SEQS_PER_RANK * H.SEQ_LEN * 2
    assert res[0][key]["rows_live"] == world * t_k
    for r in range(1, world):
        assert res[r][key]["rows_live"] == 0
        assert (res[r][key]["topk"] < 8 // world).all()
    # values: covered by test_layer_equals_local[...-rank0only]; here the gradients reached rank 0's
    # experts from every rank's tokens (rank 0's shard of dw carries all world·T·k rows)
    ref = _ref(world, dict(alignment=8, fold=False, biased=True))
    assert_scaled(res[1][key]["w13_grad"], ref["w13_grad"], TOL, "w13 grad")
    assert ref["w13_grad"][8 // world:].abs().max() == 0  # other experts saw nothing


def test_agrs_check_catches_local_only_input_gradient(world_results):
    """The mutant (dx through this rank's experts only) gives a wrong dx; the real agrs does not."""
    world, res = world_results
    ref = _ref(world, MUTANT)
    for r in range(world):
        sl = slice(r * H.SEQS_PER_RANK, (r + 1) * H.SEQS_PER_RANK)
        got = res[r][MUTANT["name"]]["x_grad"]
        assert_scaled(got, got, TOL)  # finite
        with pytest.raises(AssertionError):
            assert_scaled(got, ref["x_grad"][sl], TOL, "mutant dx")
        # ... while its forward is still right: only the backward of the all-gather was broken
        assert_scaled(res[r][MUTANT["name"]]["y"], ref["y"][sl], TOL, "mutant y")


# ------------------------------------------------------------------ bytes vs docs/design.md#dispatchers
def _rows_out_in(res, world, key, r):
    """Rows of rank r's (token, choice) pairs whose expert lives elsewhere, and rows it receives."""
    e = 8 // world
    owner = [res[s][key]["topk"] // e for s in range(world)]
    n_out = int((owner[r] != r).sum())
    n_in = sum(int((owner[s] == r).sum()) for s in range(world) if s != r)
    return n_out, n_in


@pytest.mark.parametrize("key", ["a2a-A1-nofold", "a2a-A8-fold", "a2a-A8-nofold-rank0only"])
def test_a2a_bytes(world_results, key):
    """a2a counts rows that leave / enter the rank (H·4 B each, fp32), both all-to-alls, fwd and bwd.

    Forward: dispatch sends n_out rows and receives n_in, combine the reverse; the count matrix
    adds (EP−1)·e int32 each way; folded weights add 4 B per row in the dispatch direction.
    Backward repeats the row (and weight) traffic in reverse. For a rank none of whose rows
    stay home (rank ≠ 0 in the rank-0-only case) n_out = T·k: DESIGN's T·k·H·bytes each way.
    """
    world, res = world_results
    hb = 16 * 4
    e = 8 // world
    fold = "-fold" in key
    for r in range(world):
        got = res[r][key]
        n_out, n_in = _rows_out_in(res, world, key, r)
        counts = (world - 1) * e * 4
        fwd_sent = (n_out + n_in) * hb + counts + (n_out * 4 if fold else 0)
        fwd_recv = (n_out + n_in) * hb + counts + (n_in * 4 if fold else 0)
        assert got["fwd_bytes"] == {"bytes_sent": fwd_sent, "bytes_received": fwd_recv}, (r, got["fwd_bytes"])
        step = 2 * (n_out + n_in) * hb + counts + ((n_out + n_in) * 4 if fold else 0)
        assert got["step_bytes"] == {"bytes_sent": step, "bytes_received": step}
        if key.endswith("rank0only") and r != 0:
            t_k = H.SEQS_PER_RANK * H.SEQ_LEN * 2
            assert (n_out, n_in) == (t_k, 0)
            assert got["fwd_bytes"]["bytes_sent"] - counts == t_k * hb  # T·k·H·bytes


@pytest.mark.parametrize("key", ["agrs-A1-nofold", "agrs-A8-fold"])
def test_agrs_bytes(world_results, key):
    """agrs: (EP−1)·T·H·b all-gather + the same reduce-scatter, each way, forward; again in backward.

    Plus the routing all-gather (EP−1)·T·k·(8 B id + 4 B weight) forward and the weights'
    gradient reduce-scatter (EP−1)·T·k·4 backward. Independent of the routing.
    """
    world, res = world_results
    t, h, k = H.SEQS_PER_RANK * H.SEQ_LEN, 16, 2
    tokens = 2 * (world - 1) * t * h * 4          # DESIGN: 2·(EP−1)·T·H·b per layer forward
    fwd = tokens + (world - 1) * t * k * (8 + 4)
    step = fwd + tokens + (world - 1) * t * k * 4
    for r in range(world):
        got = res[r][key]
        assert got["fwd_bytes"] == {"bytes_sent": fwd, "bytes_received": fwd}
        assert got["step_bytes"] == {"bytes_sent": step, "bytes_received": step}


def test_fsdp_bytes(world_results):
    """fsdp: the layer's expert weights, (dp−1)/dp of them each way per gather; independent of T."""
    world, res = world_results
    full = (8 * 16 * 16 + 8 * 8 * 16) * 4           # w13 [E,H,2I] + w2 [E,I,H], fp32
    shard = full // world
    for r in range(world):
        got = res[r]["fsdp-A1-nofold"]
        assert got["fwd_bytes"] == {"bytes_sent": (world - 1) * shard, "bytes_received": (world - 1) * shard}
        # backward: re-gather (reshard_after_forward) + gradient reduce-scatter
        assert got["step_bytes"]["bytes_sent"] == 3 * (world - 1) * shard
