"""Saved-for-backward bytes of the routed MoE path for each memory option (issue 6, item 5).

Measured with ``torch.autograd.graph.saved_tensors_hooks`` over dispatch -> experts -> combine
(local dispatcher, fp32 on CPU, A = 1 so M = R = T·k), counting each saved storage that
backward reads once and leaving out parameters and the layer input
(:class:`dropless.saved_bytes.SavedBytes`), and
asserted against the formula of each option:

=====================  =========================================================
option                 saved bytes (b = 4, fp32)
=====================  =========================================================
default                b·M·(2H + 3I) + 8·T·k    rows, h13, h, y; dest (int64)
recompute_swiglu       b·M·(2H + 2I) + 8·T·k    rows, h13, y; dest
recompute_fc1          b·M·2H + 8·T·k           rows, y; dest
recompute_fc1 + fold   b·M·H + b·(M+1) + 16·T·k rows, row weights (one scratch slot); dest, scatter index
... + recompute_gather b·(M+1) + 16·T·k + 8·(M+1) row weights; dest, scatter index, src (no rows at all)
=====================  =========================================================

The routing weights themselves are the router's output (an input here) and not counted.
The last line is the bound of docs/design.md#memory: one copy of the landed rows plus indices.
"""

from __future__ import annotations

import pytest
import torch

from dropless.dispatch import LocalDispatcher
from dropless.experts import GroupedExperts
from dropless.saved_bytes import SavedBytes

T, H, I, E, K = 64, 32, 16, 8, 2
M = T * K
B = 4


def saved_bytes(recompute_swiglu: bool, recompute_fc1: bool, fold: bool, gather: bool = False) -> int:
    torch.manual_seed(0)
    ex = GroupedExperts(H, I, E, recompute_swiglu=recompute_swiglu, recompute_fc1=recompute_fc1,
                        recompute_gather=gather)
    ex.init_weights(0, 0)
    x = torch.randn(T, H, requires_grad=True)
    idx = torch.randint(0, E, (T, K))
    w = torch.rand(T, K, requires_grad=True)
    disp = LocalDispatcher(E)
    with SavedBytes([*ex.parameters(), x, w]) as sb:
        if gather:
            d = disp.dispatch_source(x, idx, w, fold_weights=fold)
            y = disp.combine(ex(None, d.layout, d.row_weight_M, source=d.source), d.handle)
        else:
            d = disp.dispatch(x, idx, w, fold_weights=fold)
            y = disp.combine(ex(d.rows_MH, d.layout, d.row_weight_M), d.handle)
    y.sum().backward()  # the graph is valid and runs
    assert x.grad is not None and w.grad is not None
    return sb.total()


@pytest.mark.parametrize("opts,expected", [
    ((False, False, False), B * M * (2 * H + 3 * I) + 8 * T * K),
    ((True, False, False), B * M * (2 * H + 2 * I) + 8 * T * K),
    ((False, True, False), B * M * 2 * H + 8 * T * K),
    ((False, True, True), B * M * H + B * (M + 1) + 16 * T * K),
    ((False, True, True, True), B * (M + 1) + 16 * T * K + 8 * (M + 1)),
])
def test_saved_bytes_match_formula(opts, expected):
    assert saved_bytes(*opts) == expected


@pytest.mark.parametrize("setting,opts,extra", [
    ("default", (False, False, False), 8 * T * K),
    ("recompute_swiglu", (True, False, False), 8 * T * K),
    ("recompute_fc1", (False, True, False), 8 * T * K),
    ("recompute_fc1+fold", (False, True, True), B * (M + 1) + 16 * T * K),
    ("recompute_fc1+fold+gather", (False, True, True, True), B * (M + 1) + 16 * T * K + 8 * (M + 1)),
])
def test_planner_saved_bytes_match_the_measurement(setting, opts, extra):
    """``dropless-plan``'s per-setting figure (dropless.plan.saved_bytes) is what the layer keeps,
    less the indices and folded row weights it leaves out."""
    from dropless.plan import saved_bytes as plan_saved_bytes

    assert saved_bytes(*opts) == plan_saved_bytes(M, H, I, setting, bytes_per_element=B) + extra


def test_recompute_saves_at_most_one_copy_of_the_rows_plus_indices():
    got = saved_bytes(False, True, True)
    assert got <= B * M * H + B * (M + 1) + 16 * T * K
    assert got < saved_bytes(False, False, False) / 2


def _small_moe(**kw):
    """A small MoE layer (H 32, I 16, E 8, k 2; ModelArgs overrides in ``kw``) and its input ``[2, 24, 32]``."""
    from dropless import ModelArgs
    from dropless.moe import MoE

    opts = dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                n_group=4, topk_group=2, aux_loss_alpha=1e-3, routed_scaling_factor=2.5)
    m = MoE(ModelArgs(**{**opts, **kw}), 0)
    m.init_weights(1)
    return m, torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)


def _layer_run(**kw):
    m, x = _small_moe(**kw)
    y = m(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(6)))
    return [y, x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("kw", [dict(recompute_swiglu=True), dict(recompute_fc1=True),
                                dict(recompute_swiglu=True, fold_routing_weights=True),
                                dict(recompute_fc1=True, fold_routing_weights=True, expert_alignment=8),
                                dict(num_token_chunks=3), dict(num_token_chunks=4, recompute_fc1=True),
                                dict(recompute_gather=True), dict(recompute_gather=True, expert_alignment=8),
                                dict(recompute_gather=True, recompute_fc1=True, fold_routing_weights=True,
                                     num_token_chunks=3),
                                dict(num_token_chunks=2, expert_alignment=8, poison_padding=True,
                                     recompute_gather=True)])
def test_memory_options_give_the_same_output_and_gradients(kw):
    """Recompute, folded weights and token chunks change memory, not results (fp32, rel 1e-5)."""
    base = _layer_run()
    for got, want in zip(_layer_run(**kw), base):
        assert torch.isfinite(got).all()
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def _layer_saved(autocast: bool = False, **kw):
    """Saved-tensor bytes of a whole MoE layer (router, dispatch, experts, combine, shared expert)."""
    from dropless import ModelArgs
    from dropless.moe import MoE

    args = ModelArgs(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                     n_group=4, topk_group=2, aux_loss_alpha=1e-3, routed_scaling_factor=2.5, **kw)
    m = MoE(args, 0)
    m.init_weights(1)
    x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(5), requires_grad=True)
    with SavedBytes([*m.parameters(), x]) as sb, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = m(x)
    y.float().sum().backward()
    return sb.total()


def test_whole_layer_with_recompute_saves_less_than_one_copy_of_the_rows():
    """the bound of docs/design.md#memory for the whole layer: router, shared expert and all, below R·H·b bytes.

    With recompute_fc1 + fold + recompute_gather nothing of size R·H or T·I is saved: the
    router's fp32 gate saves the layer input itself, not an fp32 copy; the shared expert
    recomputes; the rows are re-gathered. What is left is the router's [T, E] scores and
    the indices."""
    rows = B * M * H
    full = _layer_saved()
    gathered = _layer_saved(recompute_fc1=True, fold_routing_weights=True, recompute_gather=True)
    kept = _layer_saved(recompute_fc1=True, fold_routing_weights=True)
    assert gathered < rows < full
    # recompute_gather trades the saved landed rows for the int64 source index src_M (M + 1 slots)
    assert kept - gathered == rows - 8 * (M + 1)


@pytest.mark.parametrize("kw", [dict(), dict(recompute_fc1=True, fold_routing_weights=True, recompute_gather=True)])
def test_saved_bytes_do_not_grow_with_chunks(kw):
    """The chunks share one cast of the expert weights (bf16 autocast over fp32 weights): N
    chunks save no more than one does, up to the per-chunk index tensors' spare slots."""
    one = _layer_saved(autocast=True, **kw)
    four = _layer_saved(autocast=True, num_token_chunks=4, **kw)
    assert four <= one + 64 * 4 * 3, (one, four)  # ≤ one spare slot per index tensor per chunk


def test_chunked_weight_gradients_accumulate_in_one_buffer():
    """With N chunks the experts' weight gradients are summed in place into one buffer per
    weight, in the parameter's dtype, and equal N = 1 (fp32 weights, bf16 autocast)."""
    from dropless import ModelArgs
    from dropless.moe import MoE

    grads = []
    for n in (1, 4):
        args = ModelArgs(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                         n_group=4, topk_group=2, aux_loss_alpha=0.0, num_token_chunks=n)
        m = MoE(args, 0)
        m.init_weights(1)
        x = torch.randn(1, T, H, generator=torch.Generator().manual_seed(5))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        y.float().square().sum().backward()
        assert m.experts.w13.grad.dtype == torch.float32
        grads.append([m.experts.w13.grad, m.experts.w2.grad])
    for a, b in zip(*grads):
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-2  # bf16 GEMMs over other row splits
        assert (a != 0).any()


def test_recompute_gather_needs_a_local_dispatcher():
    from dropless import ModelArgs
    from dropless.config import ConfigError
    from dropless.moe import MoE

    class Remote(LocalDispatcher):  # stands in for a2a/agrs/deepep: rows come from other ranks
        gathers_locally = False

    args = ModelArgs(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                     n_group=4, topk_group=2, recompute_gather=True)
    with pytest.raises(ConfigError, match="recompute_gather"):
        MoE(args, 0, dispatcher=Remote(E))


@pytest.mark.parametrize("kw", [dict(num_token_chunks=3),
                                dict(num_token_chunks=3, recompute_fc1=True, fold_routing_weights=True,
                                     recompute_gather=True)])
def test_memory_options_under_activation_checkpointing(kw):
    """The layer recomputed by torch.utils.checkpoint (train.activation_checkpointing) with chunks
    (a fresh gradient accumulator in the recompute) and the nested shared-expert checkpoint:
    same output and gradients as the plain layer, and the router counts its tokens once."""
    from torch.utils.checkpoint import checkpoint

    def run(ckpt, **opts):
        m, x = _small_moe(**opts)
        y = checkpoint(m, x, use_reentrant=False) if ckpt else m(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(6)))
        return [y, x.grad] + [p.grad for p in m.parameters()], m.router.tokens_per_expert.clone()

    want, counts = run(False)
    got, got_counts = run(True, **kw)
    assert torch.equal(got_counts, counts)
    for g, w in zip(got, want):
        assert ((g - w).abs().max() / w.abs().max()).item() < 1e-5


@pytest.mark.parametrize("opts", [dict(recompute_swiglu=True), dict(recompute_fc1=True)])
def test_recompute_backward_materialises_no_zero_gradients(opts):
    """The FC1 node's second output (h13, non-differentiable) must not get an all-zero [M, 2I]
    gradient allocated by autograd in backward (it did: +0.5 GiB at the V3 rank's shape)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dropless.layout import ExpertLayout

    class ZerosSpy(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.startswith("zeros") and isinstance(out, torch.Tensor):
                self.shapes.append(tuple(out.shape))
            return out

    ex = GroupedExperts(H, I, 4, **opts)
    ex.init_weights(0, 0)
    lay = ExpertLayout.from_counts(torch.tensor([10, 0, 20, 34]), 1, capacity=64)
    y = ex(torch.randn(64, H, requires_grad=True), lay)
    with ZerosSpy() as spy:
        y.sum().backward()
    assert (64, 2 * I) not in spy.shapes, spy.shapes


@pytest.mark.parametrize("gather", [False, True])
def test_fc1_output_is_rebuilt_before_each_chunks_combine_backward(monkeypatch, gather):
    """With recompute_fc1 the FC1 output of a chunk is rebuilt when the chunk's combined output
    gets its gradient, before the combine's backward lands the [M, H] row gradient (so the
    re-gathered rows are freed first), one chunk at a time; results unchanged."""
    from dropless import experts, permute
    from dropless.ops import expert_mlp

    log = []
    real_rebuild, real_bwd = expert_mlp._rebuild_h13, permute._CombineRows.backward

    def rebuild(box, *a):
        if box.h13 is None:
            log.append("h13")
        return real_rebuild(box, *a)

    def combine_bwd(ctx, grad):
        log.append("combine")
        return real_bwd(ctx, grad)

    monkeypatch.setattr(expert_mlp, "_rebuild_h13", rebuild)
    monkeypatch.setattr(permute._CombineRows, "backward", staticmethod(combine_bwd))
    kw = dict(recompute_fc1=True, fold_routing_weights=True, recompute_gather=gather, num_token_chunks=3)
    got = _layer_run(**kw)
    assert log == ["h13", "combine"] * 3, log
    log.clear()
    monkeypatch.setattr(experts.RecomputeAhead, "attach", lambda self, y: y)  # FC2's backward rebuilds it
    plain = _layer_run(**kw)
    assert log == ["combine", "h13"] * 3, log
    for a, b in zip(got, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw", [dict(num_token_chunks=3), dict(num_token_chunks=1, recompute_fc1=True),
                                dict(num_token_chunks=3, recompute_fc1=True, fold_routing_weights=True),
                                dict(num_token_chunks=3, recompute_fc1=True, fold_routing_weights=True,
                                     recompute_gather=True),
                                dict(num_token_chunks=2, recompute_swiglu=True)])
def test_partial_gradients_leave_no_stale_weight_gradient(kw):
    """``autograd.grad`` w.r.t. the input only (retain_graph), then a full backward: the weights
    get exactly the plain backward's gradients. The chunk accumulator used to add the first
    pass's weight gradients too (nobody collected them), doubling them; a pass that asks
    for some inputs only computes no other gradient."""
    def run(first):
        m, x = _small_moe(**kw)
        y = m(x)
        gx = None
        if first:
            (gx,) = torch.autograd.grad(y.square().sum(), x, retain_graph=True)
            assert all(p.grad is None for p in m.parameters())
        y.square().sum().backward()
        return gx, [x.grad] + [p.grad for p in m.parameters()]

    gx, got = run(True)
    _, want = run(False)
    assert torch.allclose(gx, want[0], rtol=1e-6, atol=1e-7)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-7)


def test_recompute_fc1_output_can_be_modified_in_place():
    """With recompute_fc1 (N = 1, no shared expert, no aux loss) the layer output is a plain
    tensor, as in the default path: the early rebuild is a gradient hook, not a view-returning
    autograd Function (PyTorch forbids in-place ops on those)."""
    outs = []
    for opts in (dict(), dict(recompute_fc1=True, fold_routing_weights=True, recompute_gather=True)):
        m, x = _small_moe(n_shared_experts=0, aux_loss_alpha=0.0, **opts)
        y = m(x)
        y.add_(1.0)
        y.square().sum().backward()
        outs.append([y.detach(), x.grad] + [p.grad for p in m.parameters()])
    for g, w in zip(*outs):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(), dict(recompute_swiglu=True),
                                dict(recompute_fc1=True, fold_routing_weights=True),
                                dict(recompute_gather=True, num_token_chunks=3)])
def test_double_backward_raises_instead_of_a_wrong_result(kw):
    """Second-order gradients through the routed experts are not supported: the custom backward
    passes (Triton kernels, recomputed inputs, in-place accumulators) are not differentiable.
    A gradient penalty through them must raise, not give a silently wrong value (recompute_swiglu
    gave d/dW13 = -1.30e-3 against -5.0e-4 by finite differences)."""
    m, x = _small_moe(**kw)
    g = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(6))
    for loss in (lambda y: y.square().sum(), lambda y: (y * g).sum()):  # the upstream gradient needs grad, or not
        with pytest.raises(RuntimeError, match="second-order gradients"):
            torch.autograd.grad(loss(m(x)), x, create_graph=True)


@pytest.mark.parametrize("one_node", [False, True])
@pytest.mark.parametrize("gather", [False, True])
def test_rebuilt_fc1_output_is_freed_before_the_fc1_gradient_gemms(monkeypatch, one_node, gather):
    """recompute_fc1: FC1's rebuilt output h13 [M, 2I] is released once SwiGLU's backward has used it,
    before the dW13 and dx GEMMs, in the two-node path and in the one node that torch.compile traces
    (run here eagerly): it never sits beside dh13 and the landed rows' gradient."""
    import weakref

    from dropless.ops import expert_mlp

    if one_node:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    h13_refs, freed_at_dw13 = [], []
    real_bwd, real_wg = expert_mlp.swiglu_bwd, expert_mlp.weight_grad

    def swiglu_bwd(h13, *a, **k):
        h13_refs.append(weakref.ref(h13))
        return real_bwd(h13, *a, **k)

    def weight_grad(x, dy, layout, be, dtype, wgrad=None):
        if dy.shape[1] == 2 * 8:  # dh13 [M, 2I]: FC1's weight gradient (FC2's dy is [M, H = 32])
            freed_at_dw13.append(h13_refs[-1]() is None)
        return real_wg(x, dy, layout, be, dtype, wgrad)

    monkeypatch.setattr(expert_mlp, "swiglu_bwd", swiglu_bwd)
    monkeypatch.setattr(expert_mlp, "weight_grad", weight_grad)
    got = _layer_run(moe_intermediate_size=8, recompute_fc1=True, recompute_gather=gather)
    assert freed_at_dw13 == [True], freed_at_dw13
    monkeypatch.undo()
    for a, b in zip(got, _layer_run(moe_intermediate_size=8)):
        assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5
