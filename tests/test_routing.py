"""Tests of dropless.routing: the DeepSeek-V3 router, its balancing and its aux loss.

References are plain-Python float64 loops of the rules in docs/design.md#the-router
and DeepSeek-V3 report eq. 12-20; the router's failure classes of docs/design.md#failure-classes.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

from dropless.config import ConfigError, ModelArgs
from dropless.routing import Router, RouterOutput, in_backward_recompute, update_router_biases


# ----------------------------------------------------------------- references
def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))


def ref_scores(logits: list[list[float]], scoring: str) -> list[list[float]]:
    out = []
    for row in logits:
        if scoring == "sigmoid":
            out.append([_sigmoid(v) for v in row])
        else:
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            z = sum(ex)
            out.append([v / z for v in ex])
    return out


def ref_route(logits, bias, *, n_group, topk_group, k, scoring="sigmoid", norm=True, scale=1.0):
    """Float64 loop version of the V3 rules. Returns (list of chosen sets, list of {expert: weight})."""
    scores = ref_scores(logits, scoring)
    E = len(bias)
    per = E // n_group
    chosen_all, weights_all = [], []
    for s in scores:
        b = [s[i] + bias[i] for i in range(E)]
        if n_group > 1:
            gscore = []
            for g in range(n_group):
                top2 = sorted(b[g * per:(g + 1) * per], reverse=True)[:2]
                gscore.append(sum(top2))
            kept = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
            masked = [b[i] if (i // per) in kept else -math.inf for i in range(E)]
        else:
            masked = b
        chosen = sorted(range(E), key=lambda i: -masked[i])[:k]
        w = [s[i] for i in chosen]
        if norm:
            z = sum(w)
            w = [v / z for v in w]
        w = [v * scale for v in w]
        chosen_all.append(set(chosen))
        weights_all.append(dict(zip(chosen, w)))
    return chosen_all, weights_all


def ref_aux_loss(logits, chosen_sets, *, E, k, alpha, seq_len, mask=None, scoring="sigmoid"):
    """DeepSeek-V3 eq. 17-20 by hand (float64), padding excluded, mean over sequences."""
    scores = ref_scores(logits, scoring)
    T = len(logits)
    losses = []
    for b0 in range(0, T, seq_len):
        toks = [t for t in range(b0, b0 + seq_len) if mask is None or mask[t]]
        if not toks:
            continue
        n = len(toks)
        L = 0.0
        for i in range(E):
            f = E / (k * n) * sum(1.0 for t in toks if i in chosen_sets[t])
            P = 1.0 / n * sum(scores[t][i] / sum(scores[t]) for t in toks)
            L += f * P
        losses.append(alpha * L)
    return sum(losses) / len(losses)


def logits64(router: Router, x_TH: torch.Tensor) -> list[list[float]]:
    return (x_TH.double() @ router.weight.detach().double().T).tolist()


def small_args(**kw) -> ModelArgs:
    d = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
             routed_scaling_factor=2.5, aux_loss_alpha=1e-2, bias_update_speed=1e-3)
    d.update(kw)
    return ModelArgs(**d)


def make_router(args: ModelArgs, layer_id: int = 0, seed: int = 0, std: float = 1.0) -> Router:
    r = Router(args, layer_id)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r.weight.normal_(0.0, std, generator=g)
    return r


# ----------------------------------------------------------- selection rules
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("grouping", [(4, 2), (1, 1), (8, 3)])
def test_router_matches_float64_reference(scoring, norm, grouping):
    n_group, topk_group = grouping
    args = small_args(scoring_func=scoring, norm_topk_prob=norm, n_group=n_group, topk_group=topk_group)
    r = make_router(args, seed=1, std=0.3)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        r.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.05)
    x = torch.randn(48, 32, generator=g)
    out = r(x)
    assert isinstance(out, RouterOutput)
    assert out.topk_idx_Tk.dtype == torch.int64 and out.topk_idx_Tk.shape == (48, 4)
    assert out.topk_weight_Tk.dtype == torch.float32 and out.scores_TE.dtype == torch.float32
    chosen, weights = ref_route(logits64(r, x), r.e_score_correction_bias.double().tolist(),
                                n_group=n_group, topk_group=topk_group, k=4, scoring=scoring,
                                norm=norm, scale=2.5)
    ref_scores_TE = torch.tensor(ref_scores(logits64(r, x), scoring), dtype=torch.float64)
    torch.testing.assert_close(out.scores_TE.double(), ref_scores_TE, rtol=1e-5, atol=1e-6)
    for t in range(48):
        got = out.topk_idx_Tk[t].tolist()
        assert set(got) == chosen[t], f"token {t}"
        for j, e in enumerate(got):
            assert out.topk_weight_Tk[t, j].item() == pytest.approx(weights[t][e], rel=1e-5, abs=1e-7)
    # counts are the selection histogram
    hist = torch.zeros(16)
    for s in chosen:
        for e in s:
            hist[e] += 1
    assert torch.equal(out.counts_E, hist)


def _identity_router(E: int, k: int, n_group: int, topk_group: int, **kw) -> Router:
    """Router with H == E and weight = I, so logits == x."""
    args = ModelArgs(hidden_size=E, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group,
                     topk_group=topk_group, **kw)
    r = Router(args, layer_id=0)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E))
    return r


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_group_limit_changes_the_choice():
    # groups of 2: g0 = (0.9, 0.1) sums 1.0; g1 = (0.8, 0.7) sums 1.5; g2, g3 low.
    probs = [0.9, 0.1, 0.8, 0.7, 0.05, 0.04, 0.03, 0.02]
    x = torch.tensor([[_logit(p) for p in probs]])
    plain_topk = set(torch.tensor(probs).topk(2).indices.tolist())
    assert plain_topk == {0, 2}
    r = _identity_router(8, 2, n_group=4, topk_group=1)
    out = r(x)
    assert set(out.topk_idx_Tk[0].tolist()) == {2, 3}
    chosen, w = ref_route(x.double().tolist(), [0.0] * 8, n_group=4, topk_group=1, k=2)
    assert chosen[0] == {2, 3}
    # weights: unbiased scores of 2 and 3, normalised over k
    got = dict(zip(out.topk_idx_Tk[0].tolist(), out.topk_weight_Tk[0].tolist()))
    assert got[2] == pytest.approx(0.8 / 1.5, rel=1e-6) and got[3] == pytest.approx(0.7 / 1.5, rel=1e-6)
    # the group score uses the top-2 sum, not the max: g0 has the best single expert
    r_v2 = _identity_router(8, 2, n_group=4, topk_group=1, topk_method="group_limited_greedy")
    assert set(r_v2(x).topk_idx_Tk[0].tolist()) == {0, 1}


def test_bias_changes_selection_not_weights():
    probs = [0.9, 0.8, 0.1, 0.2]
    x = torch.tensor([[_logit(p) for p in probs]])
    r = _identity_router(4, 2, n_group=1, topk_group=1, routed_scaling_factor=2.5)
    out0 = r(x)
    assert set(out0.topk_idx_Tk[0].tolist()) == {0, 1}
    with torch.no_grad():
        r.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 1.0, 0.0]))
    out1 = r(x)
    got = dict(zip(out1.topk_idx_Tk[0].tolist(), out1.topk_weight_Tk[0].tolist()))
    assert set(got) == {0, 2}
    # weights from the UNBIASED scores 0.9 and 0.1, normalised, x 2.5 once
    assert got[0] == pytest.approx(2.5 * 0.9 / 1.0, rel=1e-6)
    assert got[2] == pytest.approx(2.5 * 0.1 / 1.0, rel=1e-6)
    # the scores themselves are unbiased
    torch.testing.assert_close(out1.scores_TE[0], torch.tensor(probs), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm", [True, False])
def test_routed_scaling_factor_applied_once(norm):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(20, 32, generator=g)
    outs = {}
    for scale in (1.0, 2.5):
        r = make_router(small_args(routed_scaling_factor=scale, norm_topk_prob=norm), seed=3, std=0.3)
        outs[scale] = r(x)
    assert torch.equal(outs[1.0].topk_idx_Tk, outs[2.5].topk_idx_Tk)
    torch.testing.assert_close(outs[2.5].topk_weight_Tk, 2.5 * outs[1.0].topk_weight_Tk)
    if norm:
        torch.testing.assert_close(outs[2.5].topk_weight_Tk.sum(-1), torch.full((20,), 2.5))
    else:
        torch.testing.assert_close(outs[1.0].topk_weight_Tk,
                                   outs[1.0].scores_TE.gather(1, outs[1.0].topk_idx_Tk))


def test_logits_fp32_for_bf16_weights_and_buffers_stay_fp32():
    r = make_router(small_args(), seed=1, std=0.3)
    x = torch.randn(8, 32)
    r.to(torch.bfloat16)
    assert r.weight.dtype == torch.bfloat16
    assert r.e_score_correction_bias.dtype == torch.float32
    assert r.tokens_per_expert.dtype == torch.int64       # exact integer counter (issue 11 item 3)
    r.half()
    assert r.e_score_correction_bias.dtype == torch.float32 and r.tokens_per_expert.dtype == torch.int64
    r.to(torch.bfloat16)
    out = r(x.to(torch.bfloat16))
    expect = torch.sigmoid(x.to(torch.bfloat16).float() @ r.weight.float().T)
    torch.testing.assert_close(out.scores_TE, expect, rtol=0, atol=0)
    sd = r.state_dict()
    assert {"weight", "e_score_correction_bias", "tokens_per_expert"} <= set(sd)


def test_reset_parameters_seeded_and_dtype_independent():
    args = small_args(initializer_range=0.02)
    a, b = Router(args), Router(args).to(torch.bfloat16)
    a.reset_parameters(torch.Generator().manual_seed(4))
    with torch.no_grad():
        b.e_score_correction_bias.fill_(1.0)
        b.tokens_per_expert.fill_(3.0)
    b.reset_parameters(torch.Generator().manual_seed(4))
    assert torch.equal(b.weight, a.weight.to(torch.bfloat16))
    assert a.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(b.e_score_correction_bias, torch.zeros(16))
    assert torch.equal(b.tokens_per_expert, torch.zeros(16))


def test_gradients_reach_gate_weight_and_input():
    r = make_router(small_args(), seed=1, std=0.3)
    x = torch.randn(16, 32, requires_grad=True)
    out = r(x, seq_len=8)
    (out.topk_weight_Tk * torch.randn(16, 4)).sum().backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    assert x.grad.abs().sum() > 0


# ------------------------------------------------------------------ the balancing loss depends on the router
def test_aux_loss_depends_on_router_and_matches_paper():
    E, k, alpha = 4, 2, 0.1
    g = torch.Generator().manual_seed(7)
    losses = []
    for trial in range(2):
        r = _identity_router(E, k, n_group=1, topk_group=1, aux_loss_alpha=alpha)
        r.train()
        logits = (torch.randn(12, E, generator=g) * 2).requires_grad_(True)
        mask = torch.ones(12, dtype=torch.bool)
        mask[[4, 5, 11]] = False                      # padding in both sequences
        out = r(logits, seq_len=6, token_mask_T=mask)
        assert out.aux_loss.dtype == torch.float32 and out.aux_loss.dim() == 0
        chosen = [set(row) for row in out.topk_idx_Tk.tolist()]
        ref_chosen, _ = ref_route(logits.detach().double().tolist(), [0.0] * E, n_group=1,
                                  topk_group=1, k=k)
        assert chosen == ref_chosen
        expect = ref_aux_loss(logits.detach().double().tolist(), chosen, E=E, k=k, alpha=alpha,
                              seq_len=6, mask=mask.tolist())
        assert out.aux_loss.item() == pytest.approx(expect, rel=1e-5)
        # non-zero gradient wrt the logits (through P; f is a count)
        (grad,) = torch.autograd.grad(out.aux_loss, logits)
        assert grad.abs().sum() > 1e-6
        # padding tokens get no aux gradient
        assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
        losses.append(out.aux_loss.item())
    assert losses[0] != pytest.approx(losses[1], rel=1e-3)


def test_aux_loss_off_in_eval_and_alpha_zero():
    x = torch.randn(8, 32)
    r = make_router(small_args(aux_loss_alpha=1e-2), seed=1, std=0.3)
    assert r(x).aux_loss.item() > 0
    r.eval()
    out = r(x)
    assert out.aux_loss.item() == 0.0
    r0 = make_router(small_args(aux_loss_alpha=0.0), seed=1, std=0.3)
    assert r0(x).aux_loss.item() == 0.0


def test_aux_loss_one_sequence_when_seq_len_none():
    r = _identity_router(4, 2, n_group=1, topk_group=1, aux_loss_alpha=1.0)
    logits = torch.randn(9, 4, generator=torch.Generator().manual_seed(11))
    out = r(logits)
    chosen = [set(row) for row in out.topk_idx_Tk.tolist()]
    expect = ref_aux_loss(logits.double().tolist(), chosen, E=4, k=2, alpha=1.0, seq_len=9)
    assert out.aux_loss.item() == pytest.approx(expect, rel=1e-5)


def test_aux_loss_without_a_mask_equals_an_all_true_mask_and_the_paper():
    """The mask-free path (fewer kernels) against the masked one with every token real, and eq. 17-20."""
    r = _identity_router(4, 2, n_group=1, topk_group=1, aux_loss_alpha=0.1)
    r.train()
    logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    a = r(logits, seq_len=6)
    b = r(logits, seq_len=6, token_mask_T=torch.ones(12, dtype=torch.bool))
    assert torch.equal(a.topk_idx_Tk, b.topk_idx_Tk)
    torch.testing.assert_close(a.aux_loss, b.aux_loss, rtol=1e-6, atol=0)
    (ga,) = torch.autograd.grad(a.aux_loss, logits)
    (gb,) = torch.autograd.grad(b.aux_loss, logits)
    torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-12)
    chosen = [set(row) for row in a.topk_idx_Tk.tolist()]
    expect = ref_aux_loss(logits.detach().double().tolist(), chosen, E=4, k=2, alpha=0.1, seq_len=6)
    assert a.aux_loss.item() == pytest.approx(expect, rel=1e-6)


def test_account_later_equals_account_in_forward():
    """forward(account=False) leaves the counts, the aux loss and tokens_per_expert to account(out)."""
    r = make_router(small_args(aux_loss_alpha=1e-2), seed=1, std=0.3)
    r.train()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))
    full = r(x, seq_len=8)
    once = r.tokens_per_expert.clone()
    part = r(x, seq_len=8, account=False)
    assert part.aux_loss is None and part.counts_E is None
    assert torch.equal(r.tokens_per_expert, once)          # not counted yet
    assert r.account(part) is part
    assert torch.equal(part.counts_E, full.counts_E) and torch.equal(part.aux_loss, full.aux_loss)
    assert torch.equal(r.tokens_per_expert, 2 * once)
    assert torch.equal(part.topk_weight_Tk, full.topk_weight_Tk)


# ------------------------------------------------------------------ balance statistics per layer
class TwoLayers(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.layers = nn.ModuleList([Router(args, layer_id=1), Router(args, layer_id=2)])


def test_balance_stats_are_per_layer():
    E, alpha, T = 4, 1e-2, 10
    args = ModelArgs(hidden_size=4, n_routed_experts=E, num_experts_per_tok=1, n_group=1,
                     topk_group=1, aux_loss_alpha=alpha)
    model = TwoLayers(args)
    with torch.no_grad():
        for layer, hot in zip(model.layers, (0, 1)):
            layer.weight.fill_(-10.0)
            layer.weight[hot].fill_(10.0)            # logit +40 for the hot expert, -40 others
    x = torch.ones(T, 4)
    outs = [layer(x, seq_len=5) for layer in model.layers]
    assert torch.equal(outs[0].topk_idx_Tk, torch.zeros(T, 1, dtype=torch.long))
    assert torch.equal(outs[1].topk_idx_Tk, torch.ones(T, 1, dtype=torch.long))
    for layer, out in zip(model.layers, outs):
        st = layer.stats()
        assert st["max_over_mean"] == pytest.approx(E)        # maximal imbalance
        assert st["min_over_mean"] == 0.0
        assert st["empty_experts"] == E - 1
        # L <= alpha * max_i f_i * sum_i P_i = alpha * E / k; reached here
        assert st["aux_loss"] == pytest.approx(alpha * E, rel=1e-6)
        assert out.aux_loss.item() == pytest.approx(alpha * E, rel=1e-6)
    step = update_router_biases(model)
    assert set(step) == {"layer1", "layer2"}
    assert step["layer1"]["counts"] == [T, 0, 0, 0]
    assert step["layer2"]["counts"] == [0, T, 0, 0]
    for key in ("layer1", "layer2"):
        assert step[key]["max_over_mean"] == pytest.approx(E)
        assert step[key]["empty_experts"] == E - 1
        assert step[key]["aux_loss"] == pytest.approx(alpha * E, rel=1e-6)
    # bias moves against the hot expert of each layer separately
    g = args.bias_update_speed
    assert model.layers[0].e_score_correction_bias.tolist() == pytest.approx([-g, g, g, g])
    assert model.layers[1].e_score_correction_bias.tolist() == pytest.approx([g, -g, g, g])


def test_duplicate_layer_ids_rejected():
    args = small_args()
    m = nn.ModuleList([Router(args, 3), Router(args, 3)])
    with pytest.raises(ValueError, match="layer_id=3"):
        update_router_biases(m)


# ------------------------------------------------------------------ counts once per step
class CkptBlock(nn.Module):
    """A linear layer feeding the router, optionally under activation checkpointing."""

    def __init__(self, args: ModelArgs, mode: str):
        super().__init__()
        self.proj = nn.Linear(args.hidden_size, args.hidden_size)
        self.router = Router(args, layer_id=4)
        self.mode = mode
        self.calls = 0
        self.recompute_seen = 0

    def _route(self, h, mask):
        self.calls += 1
        self.recompute_seen += int(in_backward_recompute())
        o = self.router(h, seq_len=8, token_mask_T=mask)
        return o.topk_weight_Tk, o.aux_loss

    def forward(self, x, mask):
        h = self.proj(x)
        if self.mode == "none":
            return self._route(h, mask)
        return cp.checkpoint(self._route, h, mask, use_reentrant=(self.mode == "reentrant"))


@pytest.mark.parametrize("mode", ["none", "nonreentrant", "reentrant"])
def test_counts_once_per_step_under_recompute(mode):
    args = small_args(bias_update_speed=0.125)
    torch.manual_seed(0)
    block = CkptBlock(args, mode)
    with torch.no_grad():
        block.router.weight.normal_(0, 0.5)
    block.train()
    g = torch.Generator().manual_seed(9)
    micro = [torch.randn(16, 32, generator=g) for _ in range(4)]
    masks = [torch.ones(16, dtype=torch.bool) for _ in range(4)]
    masks[2][12:] = False                               # padding in one micro-batch

    # true count of the step, independently: float64 reference selection per micro-batch
    true = torch.zeros(16, dtype=torch.float64)
    with torch.no_grad():
        for x, m in zip(micro, masks):
            h = block.proj(x)
            chosen, _ = ref_route(logits64(block.router, h), [0.0] * 16, n_group=4, topk_group=2, k=4)
            for t, s in enumerate(chosen):
                if m[t]:
                    for e in s:
                        true[e] += 1
    assert true.sum() == (16 * 3 + 12) * 4

    w_out = torch.randn(16, 4, generator=g)
    for x, m in zip(micro, masks):                    # 4 gradient-accumulation micro-batches
        w, aux = block(x, m)
        ((w * w_out).sum() + aux).backward()
    expect_calls = 4 if mode == "none" else 8
    assert block.calls == expect_calls                # the recompute really ran
    assert block.recompute_seen == expect_calls - 4
    assert block.router.weight.grad is not None and block.router.weight.grad.abs().sum() > 0
    assert torch.equal(block.router.tokens_per_expert.double(), true)

    # an eval forward is not counted
    block.eval()
    block(micro[0], masks[0])
    block.train()
    assert torch.equal(block.router.tokens_per_expert.double(), true)

    before = block.router.e_score_correction_bias.clone()
    stats = update_router_biases(block)
    delta = block.router.e_score_correction_bias - before
    expect_delta = 0.125 * torch.sign(true.mean() - true)
    assert torch.equal(delta.double(), expect_delta)          # exactly ±γ or 0, once
    assert stats["layer4"]["counts"] == true.tolist()
    assert torch.equal(block.router.tokens_per_expert, torch.zeros(16))
    # a second call without new forwards does not move the bias again
    update_router_biases(block)
    assert torch.equal(block.router.e_score_correction_bias, before + delta)


# -------------------------------------------------------------- bad input
def test_non_finite_logits_raise_naming_layer_before_counting():
    r = make_router(small_args(), layer_id=5)
    x = torch.randn(4, 32)
    x[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match="layer 5.*non-finite"):
        r(x)
    assert torch.equal(r.tokens_per_expert, torch.zeros(16))
    with torch.no_grad():
        r.weight[2, 0] = float("inf")
    with pytest.raises(RuntimeError, match="layer 5"):
        r(torch.randn(4, 32))
    assert torch.equal(r.tokens_per_expert, torch.zeros(16))


@pytest.mark.parametrize("bad, kw, pattern", [
    (torch.randn(2, 4, 32), {}, "2-D"),
    (torch.randn(4, 31), {}, "hidden_size=32"),
    (torch.ones(4, 32, dtype=torch.long), {}, "floating"),
    (torch.randn(6, 32), {"seq_len": 4}, "seq_len=4"),
    (torch.randn(6, 32), {"token_mask_T": torch.ones(5, dtype=torch.bool)}, "token_mask_T"),
    (torch.randn(6, 32), {"token_mask_T": torch.ones(6)}, "token_mask_T"),
])
def test_bad_input_raises_naming_layer(bad, kw, pattern):
    r = make_router(small_args(), layer_id=7)
    with pytest.raises(ValueError, match=pattern) as ei:
        r(bad, **kw)
    assert "layer 7" in str(ei.value)
    assert torch.equal(r.tokens_per_expert, torch.zeros(16))


@pytest.mark.parametrize("kw, field", [
    ({"n_routed_experts": 10, "n_group": 4}, "n_group"),
    ({"n_group": 2, "topk_group": 3}, "topk_group"),
    ({"n_group": 8, "topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok"),
    ({"topk_method": "nope"}, "topk_method"),
])
def test_bad_config_raises_naming_field_and_layer(kw, field):
    with pytest.raises(ConfigError, match=field) as ei:
        Router(small_args(**kw), layer_id=9)
    assert "layer 9" in str(ei.value)


# ------------------------------------------------------- 2-process gloo
_COUNTS = {  # rank -> (layer 1 counts, layer 2 counts); E = 4
    0: ([10.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]),
    1: ([0.0, 0.0, 0.0, 20.0], [4.0, 3.0, 2.0, 0.0]),
}


def _bias_worker(rank: int, world: int) -> dict:
    """On each of 2 gloo ranks (tests/dist_harness.py ``run_world``): this rank's counts, one bias update."""
    import torch.distributed as dist

    args = ModelArgs(hidden_size=8, n_routed_experts=4, num_experts_per_tok=1, n_group=1,
                     topk_group=1, bias_update_speed=0.5)
    model = TwoLayers(args)
    for layer, c in zip(model.layers, _COUNTS[rank]):
        layer.tokens_per_expert.copy_(torch.tensor(c))
    calls = []
    real = dist.all_reduce

    def counting_all_reduce(*a, **k):
        calls.append(1)
        return real(*a, **k)

    dist.all_reduce = counting_all_reduce
    try:
        stats = update_router_biases(model, group=dist.group.WORLD)
    finally:
        dist.all_reduce = real
    return {"calls": len(calls), "stats": stats,
            "bias": [layer.e_score_correction_bias.clone() for layer in model.layers],
            "tpe": [layer.tokens_per_expert.clone() for layer in model.layers]}


@pytest.mark.slow
def test_update_router_biases_sums_counts_over_gloo_ranks():
    import torch.distributed as dist

    from tests import dist_harness as H

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    results = H.run_world("tests.test_routing:_bias_worker", 2)
    for layer_i, key in enumerate(("layer1", "layer2")):
        summed = torch.tensor(_COUNTS[0][layer_i]) + torch.tensor(_COUNTS[1][layer_i])
        expect_bias = 0.5 * torch.sign(summed.mean() - summed)
        for rank in range(2):
            res = results[rank]
            own = torch.tensor(_COUNTS[rank][layer_i])
            assert not torch.equal(0.5 * torch.sign(own.mean() - own), expect_bias)  # test can fail
            assert res["calls"] == 1                      # one flattened collective
            assert torch.equal(res["bias"][layer_i], expect_bias)
            assert res["stats"][key]["counts"] == summed.tolist()
            assert torch.equal(res["tpe"][layer_i], torch.zeros(4))


# ------------------------------------------------------------ exact integer counts (issue 11 item 3)
def test_counts_are_exact_integers_above_2_pow_24():
    """Counts past fp32's 2^24 limit sum exactly and give the right bias sign: an fp32 counter
    reads 2^24 + 1 rows as 2^24, so one expert one row above the others looked balanced."""
    r = make_router(small_args(bias_update_speed=0.5), seed=1, std=0.3)
    big = 1 << 24
    counts = torch.full((16,), big, dtype=torch.int64)
    counts[3] += 1
    r.tokens_per_expert.copy_(counts)
    r.train()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    out = r(x)                                           # a forward adds its 8 * 4 rows exactly
    assert out.counts_E.dtype == torch.int64 and int(out.counts_E.sum()) == 32
    assert torch.equal(r.tokens_per_expert, counts + out.counts_E)
    assert not torch.equal(r.tokens_per_expert.float().to(torch.int64), r.tokens_per_expert)  # fp32 cannot

    r.tokens_per_expert.copy_(counts)                    # the step's counts, summed: expert 3 is 1 row above
    before = r.e_score_correction_bias.clone()
    stats = update_router_biases(r)
    expect = torch.full((16,), 0.5)
    expect[3] = -0.5                                     # above the mean (2^24 + 1/16): pushed down; others up
    assert torch.equal(r.e_score_correction_bias - before, expect)
    assert torch.equal(torch.sign(counts.float().mean() - counts.float()), torch.zeros(16))  # fp32: no move
    assert stats["layer0"]["counts"] == counts.tolist()
    assert all(isinstance(c, int) for c in stats["layer0"]["counts"])
    assert stats["layer0"]["tokens"] == 16 * big + 1
    assert torch.equal(r.tokens_per_expert, torch.zeros(16, dtype=torch.int64))


def test_old_checkpoint_with_fp32_counter_loads():
    r = make_router(small_args(), seed=1, std=0.3)
    sd = {k: v.clone() for k, v in r.state_dict().items()}
    sd["tokens_per_expert"] = torch.arange(16, dtype=torch.float32) * 3      # what older versions saved
    r.load_state_dict(sd)
    assert r.tokens_per_expert.dtype == torch.int64
    assert torch.equal(r.tokens_per_expert, torch.arange(16) * 3)
    sd["tokens_per_expert"] = torch.full((16,), 0.5)
    with pytest.raises(ValueError, match="whole numbers"):
        r.load_state_dict(sd)


def test_old_dcp_checkpoint_with_fp32_counter_loads(tmp_path):
    """The trainer's checkpoints are torch.distributed.checkpoint; an fp32 counter saved by an
    older version is read into the int64 buffer exactly."""
    import torch.distributed.checkpoint as dcp

    r = make_router(small_args(), seed=1, std=0.3)
    old = {k: v.clone() for k, v in r.state_dict().items()}
    old["tokens_per_expert"] = (torch.arange(16, dtype=torch.float32) + (1 << 23))  # whole, fp32-exact
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when no process group is initialised
        dcp.save(old, checkpoint_id=str(tmp_path / "ckpt"))
        new = make_router(small_args(), seed=2, std=0.3)
        sd = new.state_dict()
        dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"))
    new.load_state_dict(sd)
    assert new.tokens_per_expert.dtype == torch.int64
    assert torch.equal(new.tokens_per_expert, torch.arange(16) + (1 << 23))
    assert torch.equal(new.weight, r.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_router_logits_on_cuda_are_fp32_of_the_bf16_values():
    """CUDA, bf16 x and weight: the logits come from the 16-bit GEMM with fp32 output and equal the
    float64 product of the same bf16 values to fp32 accumulation accuracy; gradients as the fp32 path."""
    from dropless.routing import _Fp32Logits
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 256, generator=g).bfloat16().cuda().requires_grad_()
    w = (torch.randn(64, 256, generator=g) * 0.05).bfloat16().cuda().requires_grad_()
    z = _Fp32Logits.apply(x, w)
    assert z.dtype == torch.float32
    ref = x.detach().double() @ w.detach().double().t()
    assert ((z.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # fp32 gradients of the logits spread over many binades (as a router's are): the bf16 split must
    # keep what an fp32 product keeps, up to the final bf16 rounding of dx and dw
    dz = (torch.randn(512, 64, generator=g) * torch.exp2(torch.randint(-30, 0, (512, 64), generator=g))).cuda()
    z.backward(dz)
    for got, ref in ((x.grad, dz.double() @ w.detach().double()), (w.grad, dz.double().t() @ x.detach().double())):
        assert got.dtype == torch.bfloat16
        # within one bf16 rounding (2^-8 relative) of the exact product, plus the fp32 accumulation's share
        err = (got.double() - ref).abs() / (ref.abs() + 1e-3 * ref.abs().max())
        assert err.max().item() < 2 ** -8 * 1.05, err.max().item()
    # the fp32 SIMT path the split replaces (the operands upcast) rounds to the same bf16 values but rarely
    dx32 = (dz @ w.detach().float()).bfloat16()
    assert (x.grad != dx32).float().mean().item() < 0.01
