"""Property-based sweep of the MoE layer (issue 11 item 10), with hypothesis.

Random small configs and routings: E, k (up to k = E), groups, alignment A up to 128, token
chunks, every memory option (``recompute_swiglu``, ``recompute_fc1``, ``fold_routing_weights``,
``recompute_gather``), shared experts or none, 1 to 40 tokens in 1 or more sequences, and
routings biased so that experts stay empty or every token goes to one expert. Each draw
either builds a layer whose output and gradients (input, router, experts, shared experts)
equal the float64 reference (``tests/moe_reference.reference_moe`` on the layer's own
selection), with exact zero gradients for the experts that got no row, or is a config
that :class:`~dropless.config.ConfigError` rejects, naming the field; which of the two is
decided here from the rules, independently of the code.

Derandomized (the same examples on every run, as CI needs); ``max_examples`` keeps it to
seconds on a 2-core CPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dropless import ConfigError, ModelArgs
from dropless.moe import MoE

try:
    from tests.moe_reference import reference_moe
except ImportError:  # tests/ is not a package
    from moe_reference import reference_moe

H, I = 8, 4
SETTINGS = settings(max_examples=45, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def expect_valid(E, n_group, topk_group, k) -> str | None:
    """The field a correct validator must reject, or None (the rules of docs/design.md#the-router)."""
    if E % n_group:
        return "n_group"
    if topk_group > n_group:
        return "topk_group"
    if k > topk_group * (E // n_group):
        return "num_experts_per_tok"
    if n_group > 1 and E // n_group < 2:  # noaux_tc's group score sums each group's top-2
        return "n_group"
    return None


@st.composite
def cases(draw):
    E = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    if draw(st.integers(0, 3)):  # mostly a grouping that can work, sometimes any
        n_group = draw(st.sampled_from([g for g in (1, 2, 3, 4) if E % g == 0 and (g == 1 or E // g >= 2)]))
        topk_group = draw(st.integers(1, n_group))
    else:
        n_group, topk_group = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    k = draw(st.integers(1, E))
    opts = dict(
        expert_alignment=draw(st.sampled_from([1, 2, 8, 16, 128])),
        num_token_chunks=draw(st.sampled_from([1, 2, 3, 7])),
        recompute_swiglu=draw(st.booleans()), recompute_fc1=draw(st.booleans()),
        fold_routing_weights=draw(st.booleans()), recompute_gather=draw(st.booleans()),
        n_shared_experts=draw(st.sampled_from([0, 1])),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
        norm_topk_prob=draw(st.booleans()),
    )
    batch = draw(st.integers(1, 3))
    seq = draw(st.integers(1, 13))
    routing = draw(st.sampled_from(["random", "one_expert", "some_empty"]))
    seed = draw(st.integers(0, 2**16))
    return E, n_group, topk_group, k, opts, (batch, seq), routing, seed


def _run(m: MoE, x: torch.Tensor, gy: torch.Tensor):
    seen = []
    hook = m.router.register_forward_hook(lambda mod, inp, out: seen.append(out))
    try:
        y = m(x)
    finally:
        hook.remove()
    (y * gy).sum().backward()
    return y, seen[0].topk_idx_Tk


@SETTINGS
@given(cases())
def test_moe_layer_matches_float64_reference_or_rejects_the_config(case):
    E, n_group, topk_group, k, opts, (B, S), routing, seed = case
    fields = dict(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k,
                  n_group=n_group, topk_group=topk_group, aux_loss_alpha=0.0, **opts)
    field = expect_valid(E, n_group, topk_group, k)
    event(f"rejected: {field}" if field else f"run: {routing}" + (", k = E" if k == E else ""))
    if field is not None:
        with pytest.raises(ConfigError, match=field):
            MoE(ModelArgs(**fields), 0)
        return

    m = MoE(ModelArgs(**fields), 0)
    m.init_weights(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.router.weight.normal_(0, 0.5, generator=g)
        if routing == "one_expert":      # the selection bias sends every token to expert `hot` first
            hot = seed % E
            m.router.e_score_correction_bias[hot] = 10.0
        elif routing == "some_empty" and E > k:  # experts after the first k are never chosen
            m.router.e_score_correction_bias[k:] = -10.0
    x = torch.randn(B, S, H, generator=g).requires_grad_()
    gy = torch.randn(B, S, H, generator=g)
    y, idx = _run(m, x, gy)
    T = B * S
    assert y.shape == x.shape and torch.isfinite(y).all()
    if routing == "one_expert":
        assert (idx[:, 0] == hot).all()
    if routing == "some_empty" and E > k:
        assert (idx < k).all()

    # the float64 reference on the layer's own selection, with its autograd gradients
    leaves = {"router": m.router.weight, "w13": m.experts.w13, "w2": m.experts.w2}
    if m.shared_experts is not None:
        leaves.update(sw1=m.shared_experts.w1.weight, sw3=m.shared_experts.w3.weight,
                      sw2=m.shared_experts.w2.weight)
    ref = {n: p.detach().double().requires_grad_() for n, p in leaves.items()}
    xr = x.detach().reshape(T, H).double().requires_grad_()
    shared = [ref["sw1"], ref["sw3"], ref["sw2"]] if m.shared_experts is not None else None
    yr = reference_moe(xr, ref["router"], idx, ref["w13"], ref["w2"], shared,
                       scaling=opts["routed_scaling_factor"], norm_topk_prob=opts["norm_topk_prob"])
    (yr * gy.reshape(T, H).double()).sum().backward()

    def close(got, want, what):
        scale = want.abs().max().item()
        err = (got.detach().double().reshape(want.shape) - want).abs().max().item()
        assert err <= 2e-5 * scale + 1e-9, f"{what}: max err {err:.3g} vs scale {scale:.3g}; case {case}"

    close(y.reshape(T, H), yr.detach(), "output")
    close(x.grad, xr.grad, "grad x")
    for n, p in leaves.items():
        close(p.grad, ref[n].grad, f"grad {n}")
    # experts that got no row: exact zero weight gradient (docs/design.md#the-live-row-contract, rule 4)
    used = torch.zeros(E, dtype=torch.bool)
    used[idx.reshape(-1)] = True
    for e in torch.nonzero(~used).flatten().tolist():
        assert torch.equal(m.experts.w13.grad[e], torch.zeros_like(m.experts.w13.grad[e])), e
        assert torch.equal(m.experts.w2.grad[e], torch.zeros_like(m.experts.w2.grad[e])), e
    # counts: every routed row once
    assert int(m.router.tokens_per_expert.sum()) == T * k
