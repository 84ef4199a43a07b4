"""Tests of the MoE layer (dropless.moe.MoE, local dispatcher) against a float64 reference.

The reference is ``tests/moe_reference.reference_moe``: a float64 loop over the
tokens and their k experts, with the combine weights recomputed from the router
weight (so the router gradient is checked too) and the layer's own selection.
Every output and gradient is compared: x, router weight, w13, w2 and the shared
expert's w1, w3, w2.

Tolerances, ``max|got − ref| / max|ref|`` per tensor:
* ``gemm=torch`` fp32: 1e-5 (fp32 GEMMs; observed ~1e-6).
* ``gemm=loop`` fp64: 1e-6. The router computes its logits, scores and combine
  weights in fp32 by design (docs/design.md#the-router: scores in fp32), so the
  fp64 layer agrees with the all-fp64 reference to fp32 precision only (observed ~1e-7).
"""

from __future__ import annotations

import math

import pytest
import torch

from dropless import ConfigError, ModelArgs
from dropless.dispatch import LocalDispatcher
from dropless.dispatch.a2a import A2ADispatcher
from dropless.dispatch.agrs import AGRSDispatcher
from dropless.dispatch.fsdp import FSDPDispatcher
from dropless.experts import GroupedExperts
from dropless.moe import MoE, capacity_drop
from tests.once_rounded import bf16_ulp

try:
    from tests.moe_reference import reference_moe
except ImportError:  # tests/ is not a package
    from moe_reference import reference_moe

H, I = 32, 16
TOL = {"torch": 1e-5, "loop": 1e-6}
DTYPE = {"torch": torch.float32, "loop": torch.float64}


def make_layer(*, A=8, gemm="torch", poison=True, seed=1, layer_id=3, **kw) -> MoE:
    fields = dict(hidden_size=H, moe_intermediate_size=I, n_routed_experts=8, num_experts_per_tok=2,
                  n_group=4, topk_group=2, aux_loss_alpha=0.0, routed_scaling_factor=2.5,
                  expert_alignment=A, gemm=gemm, poison_padding=poison)
    fields.update(kw)
    m = MoE(ModelArgs(**fields), layer_id=layer_id).to(DTYPE[gemm])
    m.init_weights(seed)
    return m


def params(m: MoE) -> dict[str, torch.nn.Parameter]:
    out = {"router.weight": m.router.weight, "w13": m.experts.w13, "w2": m.experts.w2}
    if m.shared_experts is not None:
        out.update({"shared.w1": m.shared_experts.w1.weight, "shared.w3": m.shared_experts.w3.weight,
                    "shared.w2": m.shared_experts.w2.weight})
    return out


def forward_backward(m: MoE, x: torch.Tensor, gy: torch.Tensor):
    """Run the layer; return output, grads (x first, then params) and the router's selection."""
    for p in m.parameters():
        p.grad = None
    seen = []
    hook = m.router.register_forward_hook(lambda mod, inp, out: seen.append(out))
    x = x.detach().clone().requires_grad_(True)
    try:
        y = m(x)
    finally:
        hook.remove()
    (y * gy).sum().backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in params(m).items()})
    return y.detach(), grads, seen[0].topk_idx_Tk


def reference(m: MoE, x: torch.Tensor, gy: torch.Tensor, idx: torch.Tensor, reference_fn=None, **kw):
    """The float64 reference output and gradients for the layer's selection ``idx``."""
    ps = params(m)
    leaves = {n: p.detach().double().requires_grad_(True) for n, p in ps.items()}
    xr = x.detach().reshape(-1, H).double().requires_grad_(True)
    shared = [leaves[n] for n in ("shared.w1", "shared.w3", "shared.w2")] if m.shared_experts is not None else None
    fn = reference_fn or reference_moe
    yr = fn(xr, leaves["router.weight"], idx, leaves["w13"], leaves["w2"], shared,
            scaling=m.args.routed_scaling_factor, norm_topk_prob=m.args.norm_topk_prob, **kw)
    (yr * gy.reshape(-1, H).double()).sum().backward()
    grads = {"x": xr.grad}
    grads.update({n: leaves[n].grad for n in ps})
    return yr, grads


def check_layer(m: MoE, x: torch.Tensor, close, seed=0, reference_fn=None, **ref_kw):
    g = torch.Generator().manual_seed(seed)
    gy = torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype)
    y, grads, idx = forward_backward(m, x, gy)
    yr, grads_r = reference(m, x, gy, idx, reference_fn, **ref_kw)
    tol = TOL[m.args.gemm]
    close(y.reshape(-1, H), yr, tol, "output")
    for name, gr in grads_r.items():
        got = grads[name].reshape(gr.shape)
        close(got, gr, tol, f"grad {name}")
    return y, grads, idx


def rand_x(t=48, dtype=torch.float32, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, t // batch, H, generator=g, dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------- vs reference
@pytest.mark.parametrize("gemm", ["torch", "loop"])
@pytest.mark.parametrize("A", [1, 8, 128])
def test_random_routing_matches_reference(gemm, A, close):
    m = make_layer(A=A, gemm=gemm, poison=True)
    x = rand_x(dtype=DTYPE[gemm], seed=A)
    y, grads, idx = check_layer(m, x, close, seed=A)
    assert y.dtype == x.dtype and y.shape == x.shape
    t, k = 48, 2
    assert int(m.last_stats["rows_live"]) == t * k
    # the layer's rows are laid out with the configured alignment and the exact bound
    assert int(m.last_stats["rows_capacity"]) == t * k + (8 - 1) * (A - 1)


@pytest.mark.parametrize("gemm", ["torch", "loop"])
def test_without_poison_and_without_shared_expert(gemm, close):
    m = make_layer(A=8, gemm=gemm, poison=False, n_shared_experts=0)
    assert m.shared_experts is None
    check_layer(m, rand_x(dtype=DTYPE[gemm], seed=7), close, seed=7)


@pytest.mark.parametrize("gemm", ["torch", "loop"])
@pytest.mark.parametrize("A", [1, 128])
def test_empty_experts_via_selection_bias(gemm, A, close):
    """Experts 2, 3 (one whole group) and 5 pushed out by a large negative bias.

    The bias changes the selection only: experts 0 and 6 get a small positive bias,
    which changes which experts are chosen but not the combine weights (the reference
    recomputes them from the unbiased scores).
    """
    m = make_layer(A=A, gemm=gemm)
    bias = torch.tensor([0.05, 0.0, -1e4, -1e4, 0.0, -1e4, 0.02, 0.0])
    m.router.e_score_correction_bias.copy_(bias)
    y, grads, idx = check_layer(m, rand_x(dtype=DTYPE[gemm], seed=11), close, seed=11)
    used = set(idx.flatten().tolist())
    assert used.isdisjoint({2, 3, 5}) and len(used) >= 3
    for e in (2, 3, 5):
        assert torch.equal(grads["w13"][e], torch.zeros_like(grads["w13"][e]))
        assert torch.equal(grads["w2"][e], torch.zeros_like(grads["w2"][e]))
    # the positive bias did change the selection: expert 0 is chosen by more tokens than without it
    m.router.e_score_correction_bias.zero_()
    _, _, idx0 = forward_backward(m, rand_x(dtype=DTYPE[gemm], seed=11), torch.zeros(2, 24, H, dtype=DTYPE[gemm]))
    assert (idx == 0).sum() > (idx0 == 0).sum()


@pytest.mark.parametrize("gemm", ["torch", "loop"])
@pytest.mark.parametrize("A", [1, 128])
def test_all_tokens_to_one_expert(gemm, A, close):
    """Top-1, no groups, expert 6 biased up: every row lands on expert 6, nothing dropped."""
    m = make_layer(A=A, gemm=gemm, num_experts_per_tok=1, n_group=1, topk_group=1, norm_topk_prob=False)
    m.router.e_score_correction_bias[6] = 10.0
    y, grads, idx = check_layer(m, rand_x(dtype=DTYPE[gemm], seed=3), close, seed=3)
    assert (idx == 6).all()
    assert int(m.last_stats["rows_live"]) == 48
    others = [e for e in range(8) if e != 6]
    assert torch.equal(grads["w13"][others], torch.zeros_like(grads["w13"][others]))
    assert grads["router.weight"].abs().sum() > 0    # weights are unnormalised sigmoid scores here


@pytest.mark.parametrize("gemm", ["torch", "loop"])
def test_softmax_scoring(gemm, close):
    m = make_layer(A=8, gemm=gemm, scoring_func="softmax")
    check_layer(m, rand_x(dtype=DTYPE[gemm], seed=5), close, seed=5, scoring="softmax")


# ----------------------------------------------------------------- determinism, fold
@pytest.mark.parametrize("poison", [False, True])
def test_bitwise_deterministic(poison):
    m = make_layer(A=8, gemm="torch", poison=poison)
    x = rand_x(seed=21)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    y1, g1, i1 = forward_backward(m, x, gy)
    g1 = {n: t.clone() for n, t in g1.items()}
    y2, g2, i2 = forward_backward(m, x, gy)
    assert torch.equal(i1, i2) and torch.equal(y1, y2)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n


@pytest.mark.parametrize("gemm, tol", [("torch", 1e-5), ("loop", 1e-12)])
@pytest.mark.parametrize("A", [1, 128])
def test_fold_routing_weights_same_result(gemm, tol, A, close):
    x = rand_x(dtype=DTYPE[gemm], seed=13)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(x.dtype)
    out = {}
    for fold in (False, True):
        m = make_layer(A=A, gemm=gemm, fold_routing_weights=fold)
        out[fold] = forward_backward(m, x, gy)
    (y0, g0, i0), (y1, g1, i1) = out[False], out[True]
    assert torch.equal(i0, i1)
    close(y1, y0, tol, "output")
    for n in g0:
        close(g1[n], g0[n], tol, f"grad {n}")


# ----------------------------------------------------------------- capacity-factor baseline
def py_capacity_drop(idx: list[list[int]], e: int, cf: float):
    """Keep each expert's first C = ceil(cf·T·k/E) choices in (token, choice) order."""
    t, k = len(idx), len(idx[0])
    cap = math.ceil(cf * t * k / e)
    seen = [0] * e
    keep = []
    for row in idx:
        krow = []
        for ex in row:
            krow.append(seen[ex] < cap)
            seen[ex] += 1
        keep.append(krow)
    kept = sum(min(s, cap) for s in seen)
    dropped = t * k - kept
    padded = e * cap - kept
    return keep, dropped, padded


def test_capacity_drop_known_counts():
    # T = 6, k = 2, E = 3: counts [7, 3, 2]; C = ceil(1.0 * 12 / 3) = 4
    idx = [[0, 1], [0, 2], [1, 0], [0, 0], [2, 0], [0, 1]]
    keep, dropped, padded = py_capacity_drop(idx, 3, 1.0)
    assert (dropped, padded) == (3, 3)
    got_idx, got_dropped, got_padded = capacity_drop(torch.tensor(idx), 3, 1.0)
    want = [[ex if kp else -1 for ex, kp in zip(r, kr)] for r, kr in zip(idx, keep)]
    assert got_idx.tolist() == want
    assert int(got_dropped) == dropped and int(got_padded) == padded


def test_capacity_drop_seed_numbers():
    """docs/design.md#a-worked-rank: counts [21733, 15004, 17982, 10817], cf 1.0 drops 6,947 rows, pads 6,947."""
    counts = [21733, 15004, 17982, 10817]
    labels = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    g = torch.Generator().manual_seed(0)
    idx = labels[torch.randperm(labels.numel(), generator=g)].view(8192, 8)
    keep, dropped, padded = py_capacity_drop(idx.tolist(), 4, 1.0)
    assert (dropped, padded) == (6947, 6947)
    got_idx, got_dropped, got_padded = capacity_drop(idx, 4, 1.0)
    assert int(got_dropped) == 6947 and int(got_padded) == 6947
    assert torch.equal(got_idx >= 0, torch.tensor(keep))
    assert torch.equal(got_idx[got_idx >= 0], idx[got_idx >= 0])
    kept_counts = torch.bincount(got_idx[got_idx >= 0], minlength=4).tolist()
    assert kept_counts == [min(c, 16384) for c in counts]


@pytest.mark.parametrize("gemm", ["torch", "loop"])
def test_moe_with_capacity_factor_reports_drops(gemm, close, ref_moe):
    """Expert 0 biased up: most tokens choose it, C = ceil(1.0·48·2/8) = 12 rows each are kept."""
    m = make_layer(A=8, gemm=gemm, capacity_factor=1.0)
    m.router.e_score_correction_bias[0] = 0.5
    x = rand_x(dtype=DTYPE[gemm], seed=17)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(x.dtype)
    y, grads, idx = forward_backward(m, x, gy)
    keep, dropped, padded = py_capacity_drop(idx.tolist(), 8, 1.0)
    assert dropped > 0
    st = m.last_stats
    assert int(st["rows_dropped"]) == dropped and int(st["rows_padded"]) == padded
    assert int(st["rows_live"]) == 96 - dropped
    yr, grads_r = reference(m, x, gy, idx, ref_moe, keep_Tk=torch.tensor(keep))
    tol = TOL[gemm]
    close(y.reshape(-1, H), yr, tol, "output")
    for name, gr in grads_r.items():
        close(grads[name].reshape(gr.shape), gr, tol, f"grad {name}")


def test_moe_without_capacity_factor_drops_nothing():
    m = make_layer(A=8, gemm="torch")
    m.router.e_score_correction_bias[0] = 0.5        # the same skew: nothing is dropped
    m(rand_x(seed=17))
    st = m.last_stats
    assert int(st["rows_live"]) == 96
    # MoE docstring: rows_dropped / rows_padded are 0 when dropless
    assert int(st["rows_dropped"]) == 0 and int(st["rows_padded"]) == 0


# ----------------------------------------------------------------- bad input
def test_bad_x_shape_and_dtype():
    m = make_layer()
    for bad in (torch.randn(H), torch.randn(2, 3, 4, H), torch.randn(5, H + 1), torch.ones(5, H, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"MoE layer 3: x must be floating .*hidden_size=32"):
            m(bad)


@pytest.mark.parametrize("fields, field", [
    (dict(n_routed_experts=6, n_group=4), "n_group=4 \\(layer 5\\).*divide n_routed_experts=6"),
    (dict(n_group=4, topk_group=5), "topk_group=5 \\(layer 5\\).*<= n_group=4"),
    (dict(num_experts_per_tok=5, n_group=4, topk_group=2), "num_experts_per_tok=5 \\(layer 5\\).*2\\*2"),
    (dict(expert_alignment=0), "expert_alignment=0 \\(layer 5\\)"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0 \\(layer 5\\)"),
])
def test_bad_config_names_field_and_layer(fields, field):
    with pytest.raises(ConfigError, match=field):
        make_layer(layer_id=5, **fields)


def test_bad_gemm_backend():
    with pytest.raises(ValueError, match="gemm='nope': unknown grouped GEMM backend"):
        MoE(ModelArgs(hidden_size=H, gemm="nope"), layer_id=1)
    m = make_layer(gemm="torch")
    with pytest.raises(ValueError, match="use gemm=loop"):
        m.double()(rand_x(dtype=torch.float64))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_router_logits(bad):
    m = make_layer()
    m.train()
    x = rand_x(seed=1)
    m(x)                                     # one good forward: counts move
    counts = m.router.tokens_per_expert.clone()
    assert counts.sum() == 96
    x[0, 3, 5] = bad
    with pytest.raises(RuntimeError, match=r"Router \(layer 3\): non-finite router logits"):
        m(x)
    # raised before anything is updated
    assert torch.equal(m.router.tokens_per_expert, counts)


def test_experts_shapes():
    ex = GroupedExperts(H, I, 4, gemm="loop")
    assert ex.w13.shape == (4, H, 2 * I) and ex.w2.shape == (4, I, H)


@pytest.mark.parametrize("kw", [{}, dict(num_token_chunks=3),
                                dict(recompute_fc1=True, fold_routing_weights=True, recompute_gather=True)])
def test_zero_tokens(kw):
    """A rank with no tokens ([0, H]): an empty output, zero expert gradients, no error."""
    from dropless import ModelArgs
    from dropless.moe import MoE

    m = MoE(ModelArgs(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                      n_group=4, topk_group=2, n_shared_experts=1, **kw))
    m.init_weights(0)
    x = torch.randn(0, 64, requires_grad=True)
    y = m(x)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 64)
    assert m.experts.w13.grad is None or not m.experts.w13.grad.any()


# ----------------------------------------------------------------- bf16 output: one rounding
def _cancelling_bf16_layer(dispatcher: str, **kw) -> MoE:
    """A bf16 layer whose routed experts are the shared expert with ``w2`` negated and scaled by
    0.93 … 1.07: the routed sum and the shared output nearly cancel on every token."""
    e = 8
    disp = {"local": LocalDispatcher(e), "fsdp": FSDPDispatcher(e), "a2a": A2ADispatcher(e, None),
            "agrs": AGRSDispatcher(e, None)}[dispatcher]
    fields = dict(hidden_size=H, moe_intermediate_size=I, n_routed_experts=e, num_experts_per_tok=2, n_group=4,
                  topk_group=2, aux_loss_alpha=0.0, routed_scaling_factor=1.0, expert_alignment=8,
                  n_shared_experts=1)
    fields.update(kw)
    m = MoE(ModelArgs(**fields), layer_id=0, dispatcher=disp)
    m.init_weights(5)
    sh = m.shared_experts
    with torch.no_grad():
        for i in range(e):
            m.experts.w13[i].copy_(torch.cat([sh.w1.weight.t(), sh.w3.weight.t()], dim=1))
            m.experts.w2[i].copy_(-sh.w2.weight.t() * (0.93 + 0.02 * i))
    return m.to(torch.bfloat16)


ONCE_PATHS = [("local", {}), ("fsdp", {}), ("a2a", {}), ("agrs", {}),
              ("local", dict(num_token_chunks=3)), ("a2a", dict(num_token_chunks=3)),
              ("agrs", dict(num_token_chunks=2)), ("local", dict(fold_routing_weights=True)),
              ("local", dict(recompute_fc1=True, recompute_swiglu=True)),
              ("local", dict(recompute_gather=True, num_token_chunks=2)),
              ("fsdp", dict(recompute_fc1=True, recompute_gather=True, fold_routing_weights=True))]


@pytest.mark.parametrize("dispatcher, kw", ONCE_PATHS, ids=[f"{d}-{'-'.join(k) or 'plain'}" for d, k in ONCE_PATHS])
def test_bf16_output_is_the_float64_sum_rounded_once(dispatcher, kw):
    """bf16 routed and shared outputs that nearly cancel: the layer's output is their float64 sum
    rounded once to bf16, up to the fp32 accumulation's own error (every dispatcher, chunked,
    folded, recomputed).

    The reference: each chunk's expert outputs ``y_MH`` (bf16, as the experts gave them) combined
    by the dispatcher in float64 (rows in fp64: an fp64 accumulator), plus the shared experts'
    bf16 output, in float64. Bound per element: half a bf16 ulp of the result plus
    ``(2k + 2)·2^-24·Σ|terms|`` (fp32 products and sums). A routed sum rounded to bf16 before the
    shared output joins it misses by up to half a bf16 ulp of the routed sum, which is far larger
    where they cancel.
    """
    m = _cancelling_bf16_layer(dispatcher, **kw)
    disp = m.dispatcher
    real = disp.combine_async
    routed64, abs64, shared = [], [], []

    def spy(y_MH, handle, *rest):
        with torch.no_grad():
            routed64.append(real(y_MH.detach().double(), handle).wait())
            abs64.append(real(y_MH.detach().double().abs(), handle).wait())
        return real(y_MH, handle, *rest)

    disp.combine_async = spy
    hook = m.shared_experts.register_forward_hook(lambda mod, inp, out: shared.append(out.detach().double()))
    x = torch.randn(48, H, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16).requires_grad_()
    try:
        y = m(x)
    finally:
        hook.remove()
    y.float().sum().backward()  # backward runs on every path (recompute, re-gather)
    exact = torch.cat(routed64) + shared[0]
    terms = torch.cat(abs64) + shared[0].abs()
    k = m.args.num_experts_per_tok
    bound = 0.5 * bf16_ulp(exact.abs() + terms * 2.0 ** -20) + (2 * k + 2) * 2.0 ** -24 * terms
    err = (y.double() - exact).abs()
    assert y.dtype == torch.bfloat16 and x.grad is not None
    assert (err <= bound).all(), f"{int((err > bound).sum())} of {err.numel()} outputs off by up to " \
                                 f"{float((err / bf16_ulp(exact)).max()):.1f} ulp"
    assert (exact.abs() < 2.0 ** -4 * terms).float().mean() > 0.5  # most outputs do nearly cancel
