"""Failure classes of public MoE code (docs/design.md#failure-classes), with the right value asserted.

* padding leaks (e.g. huggingface/transformers#45621: uninitialised rows times a zero weight):
  unwritten padding rows must not leak (2048 tokens, top-1 over 8 experts, static capacity
  2304, A = 1 and A = 128, NaN in every padding row of every intermediate and of its
  gradient, two forward+backward passes).
* a tile spans two experts (e.g. tile-ai/TileOPs#1952): segment starts not on the kernel's
  128-row tile (rows [128, 130, 65], A = 64).
* everything to one expert (5 tokens / 4 experts, and 4096 tokens).

Empty experts (pytorch/pytorch#172439) are in test_grouped_gemm.py; the router's classes in
test_routing.py.

References are float64: ``reference_moe`` (the per-token loop of tests/moe_reference.py) and
its batched form ``ref_moe_batched`` (conftest.py, checked against it below).
Tolerances ``max|got − ref| / max|ref|``: ``torch`` fp32 1e-5; ``loop`` fp64 1e-12 where
no router is involved, 1e-6 through the router (fp32 scores by design, docs/design.md#the-router).
"""

from __future__ import annotations

import gc

import pytest
import torch

from dropless import ModelArgs
from dropless.dispatch import LocalDispatcher
from dropless.experts import GroupedExperts
from dropless.layout import ExpertLayout
from dropless.moe import MoE
from dropless.ops import grouped_mm
from dropless.ops.swiglu import swiglu
from tests.conftest import py_layout

try:
    from tests.moe_reference import reference_moe
except ImportError:  # tests/ is not a package
    from moe_reference import reference_moe

H, I = 32, 16
DTYPE = {"torch": torch.float32, "loop": torch.float64}
TOL_EXPERTS = {"torch": 1e-5, "loop": 1e-12}
TOL_LAYER = {"torch": 1e-5, "loop": 1e-6}
ROWS03 = [299, 254, 158, 278, 167, 343, 263, 286]
ROWS04 = [128, 130, 65]


def py_segments(counts, a):
    """``[(start, end)]`` of each expert (:func:`tests.conftest.py_layout`)."""
    return list(zip(*py_layout(counts, a)))


def make_experts(e, gemm, seed=1, std=0.2):
    """Experts that poison their padding rows (NaN in every intermediate's padding and its gradient)."""
    ex = GroupedExperts(H, I, e, gemm=gemm, poison=True).to(DTYPE[gemm])
    ex.init_weights(seed, layer_id=0, std=std)
    return ex


# ----------------------------------------------------------------- the batched reference
def test_batched_reference_equals_token_loop(ref_moe):
    g = torch.Generator().manual_seed(0)
    t, e, k = 16, 6, 2
    x = torch.randn(t, H, dtype=torch.float64, generator=g, requires_grad=True)
    rw = torch.randn(e, H, dtype=torch.float64, generator=g, requires_grad=True)
    w13 = torch.randn(e, H, 2 * I, dtype=torch.float64, generator=g, requires_grad=True)
    w2 = torch.randn(e, I, H, dtype=torch.float64, generator=g, requires_grad=True)
    sh = [torch.randn(s, dtype=torch.float64, generator=g, requires_grad=True) for s in ((8, H), (8, H), (H, 8))]
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    leaves = [x, rw, w13, w2, *sh]
    for norm in (True, False):
        y1 = reference_moe(x, rw, idx, w13, w2, sh, scaling=2.5, norm_topk_prob=norm)
        g1 = torch.autograd.grad(y1.square().sum(), leaves)
        y2 = ref_moe(x, rw, idx, w13, w2, sh, scaling=2.5, norm_topk_prob=norm)
        g2 = torch.autograd.grad(y2.square().sum(), leaves)
        torch.testing.assert_close(y2, y1, rtol=1e-10, atol=1e-10)
        for a, b in zip(g2, g1):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------- padding leaks
def padding_leak_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.cat([torch.full((c,), e) for e, c in enumerate(ROWS03)])
    idx = labels[torch.randperm(labels.numel(), generator=g)].view(-1, 1)
    x = torch.randn(2048, H, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.rand(2048, 1, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    gy = torch.randn(2048, H, generator=g, dtype=torch.float64).to(dtype)
    return idx, x, w, gy


def padding_leak_pass(experts, idx, x, w, gy, alignment, capacity, fold):
    """One forward+backward through dispatch -> experts (poisoned) -> combine."""
    disp = LocalDispatcher(8)
    experts.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    d = disp.dispatch(x, idx, w, alignment=alignment, capacity=capacity, fold_weights=fold)
    assert d.layout.capacity == capacity
    assert d.layout.counts.tolist() == ROWS03
    live = d.layout.live_mask()
    assert int((~live).sum()) == capacity - 2048 > 0
    y_MH = experts(d.rows_MH, d.layout, d.row_weight_M)
    assert torch.isnan(y_MH[~live]).all()          # the poison is really there
    out = disp.combine(y_MH, d.handle)
    out.backward(gy)
    return out.detach(), {"x": x.grad, "w": w.grad, "w13": experts.w13.grad.clone(), "w2": experts.w2.grad.clone()}


@pytest.mark.parametrize("gemm", ["torch", "loop"])
@pytest.mark.parametrize("alignment, capacity", [(1, 2304), (128, 3072)])
@pytest.mark.parametrize("fold", [False, True])
def test_padding_rows_never_leak(gemm, alignment, capacity, fold, ref_moe, close):
    dtype = DTYPE[gemm]
    idx, x, w, gy = padding_leak_inputs(dtype)
    experts = make_experts(8, gemm)
    # float64 reference and its gradients
    xr = x.detach().double().clone().requires_grad_(True)
    wr = w.detach().double().clone().requires_grad_(True)
    w13 = experts.w13.detach().double().requires_grad_(True)
    w2 = experts.w2.detach().double().requires_grad_(True)
    yr = ref_moe(xr, None, idx, w13, w2, None, topk_weight_Tk=wr)
    yr.backward(gy.double())
    want = {"x": xr.grad, "w": wr.grad, "w13": w13.grad, "w2": w2.grad}

    tol = TOL_EXPERTS[gemm]
    runs = []
    for _ in range(2):   # the second pass runs in memory the first one freed
        out, grads = padding_leak_pass(experts, idx, x, w, gy, alignment, capacity, fold)
        close(out, yr, tol, "output")
        assert torch.isfinite(out[0]).all()      # token 0: where leaked padding rows were added
        for n in want:
            close(grads[n], want[n], tol, f"grad {n}")
        runs.append((out, grads))
        gc.collect()
    (o1, g1), (o2, g2) = runs
    assert torch.equal(o1, o2) and all(torch.equal(g1[n], g2[n]) for n in g1)


def test_capacity_too_small_for_alignment_raises():
    """With A = 128 these rows need 2590 rows: capacity 2304 is refused, never silently dropped."""
    seg = py_segments(ROWS03, 128)
    assert seg[-1][1] == 2590
    idx, x, w, _ = padding_leak_inputs(torch.float32)
    with pytest.raises(RuntimeError, match="overflow the buffer capacity M"):
        LocalDispatcher(8).dispatch(x, idx, w, alignment=128, capacity=2304)


# ----------------------------------------------------------------- a tile spans two experts
def tile_span_owner():
    seg = py_segments(ROWS04, 64)
    assert seg == [(0, 128), (128, 258), (320, 385)]
    owner = [-1] * 385
    for e, (s, t) in enumerate(seg):
        for r in range(s, t):
            owner[r] = e
    return seg, owner


@pytest.mark.parametrize("gemm, dtype, tol", [("torch", torch.float32, 1e-5), ("torch", torch.bfloat16, 1e-2),
                                              ("loop", torch.float64, 1e-12)])
def test_every_row_uses_its_own_expert(gemm, dtype, tol, close):
    seg, owner = tile_span_owner()
    lay = ExpertLayout.from_counts(torch.tensor(ROWS04), alignment=64, capacity=385)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(385, H, generator=g).to(dtype)
    w = torch.randn(3, H, 2 * I, generator=g).to(dtype)
    x[torch.tensor([o < 0 for o in owner])] = float("nan")
    out = grouped_mm(x, w, lay, gemm)
    for r, e in enumerate(owner):
        if e >= 0:   # row by row: x[r] @ w[own expert of r]
            close(out[r], x[r].double() @ w[e].double(), tol, f"row {r} (expert {e})")


@pytest.mark.parametrize("gemm", ["torch", "loop"])
def test_swiglu_experts_row_by_row_across_tiles(gemm, close):
    seg, owner = tile_span_owner()
    lay = ExpertLayout.from_counts(torch.tensor(ROWS04), alignment=64, capacity=385)
    ex = make_experts(3, gemm, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(385, H, generator=g, dtype=torch.float64).to(DTYPE[gemm])
    y = ex(x, lay)
    w13, w2 = ex.w13.detach().double(), ex.w2.detach().double()
    for r, e in enumerate(owner):
        if e >= 0:
            want = swiglu(x[r].double() @ w13[e]) @ w2[e]
            close(y[r], want, TOL_EXPERTS[gemm], f"row {r} (expert {e})")


def test_tile_schedule_never_mixes_experts():
    """A kernel tiling rows by 128 through ExpertLayout.tiles(128) uses each row's own expert."""
    seg, owner = tile_span_owner()
    lay = ExpertLayout.from_counts(torch.tensor(ROWS04), alignment=64, capacity=385)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(385, H, dtype=torch.float64, generator=g)
    w = torch.randn(3, H, 8, dtype=torch.float64, generator=g)
    want = torch.full((385, 8), float("nan"), dtype=torch.float64)
    for r, e in enumerate(owner):
        if e >= 0:
            want[r] = x[r] @ w[e]

    def tile_kernel(tile_expert, tile_row, ends):
        out = torch.full((385, 8), float("nan"), dtype=torch.float64)
        for e, r0 in zip(tile_expert, tile_row):
            if e >= 0:
                r1 = min(r0 + 128, ends[e])
                out[r0:r1] = x[r0:r1] @ w[e]
        return out

    tile_expert, tile_row, _ = lay.tiles(128)
    got = tile_kernel(tile_expert.tolist(), tile_row.tolist(), lay.end.tolist())
    live = torch.tensor([o >= 0 for o in owner])
    torch.testing.assert_close(got[live], want[live], rtol=0, atol=0)
    # the fault of this class: tiles on multiples of 128 taking the expert of their first row
    naive_rows = list(range(0, 385, 128))
    naive = tile_kernel([owner[r] for r in naive_rows], naive_rows, [385] * 3)
    wrong = [r for r in range(385) if live[r] and not torch.equal(naive[r], want[r])]
    assert wrong == list(range(320, 384))


# ----------------------------------------------------------------- everything to one expert
def one_expert_layer(e, target, gemm, A, t, norm, seed=0):
    """Top-1 layer whose router weight makes every (positive) token prefer expert ``target``."""
    args = ModelArgs(hidden_size=H, moe_intermediate_size=I, n_routed_experts=e, num_experts_per_tok=1,
                     n_group=1, topk_group=1, aux_loss_alpha=0.0, routed_scaling_factor=2.5,
                     norm_topk_prob=norm, expert_alignment=A, gemm=gemm, poison_padding=True)
    m = MoE(args, layer_id=0).to(DTYPE[gemm])
    m.init_weights(seed)
    with torch.no_grad():
        m.router.weight.fill_(-0.05)
        m.router.weight[target] = 0.05
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(t, H, generator=g, dtype=torch.float64) + 0.1).to(DTYPE[gemm])   # every token prefers target
    gy = torch.randn(t, H, generator=g, dtype=torch.float64).to(DTYPE[gemm])
    return m, x, gy


def run_one_expert(m, x, gy, reference_fn, close, e, target):
    seen = []
    hook = m.router.register_forward_hook(lambda mod, inp, out: seen.append(out))
    xg = x.clone().requires_grad_(True)
    y = m(xg)
    hook.remove()
    (y * gy).sum().backward()
    r = seen[0]
    t = x.shape[0]
    assert (r.topk_idx_Tk == target).all()
    assert r.counts_E.tolist() == [float(t) if i == target else 0.0 for i in range(e)]
    assert int(m.last_stats["rows_live"]) == t            # expert `target` received every row
    assert int(m.last_stats.get("rows_dropped", 0)) == 0
    ps = [m.router.weight, m.experts.w13, m.experts.w2, m.shared_experts.w1.weight,
          m.shared_experts.w3.weight, m.shared_experts.w2.weight]
    leaves = [p.detach().double().requires_grad_(True) for p in ps]
    xr = x.detach().double().clone().requires_grad_(True)
    yr = reference_fn(xr, leaves[0], r.topk_idx_Tk, leaves[1], leaves[2], leaves[3:], scaling=2.5,
                      norm_topk_prob=m.args.norm_topk_prob)
    (yr * gy.double()).sum().backward()
    tol = TOL_LAYER[m.args.gemm]
    close(y, yr, tol, "output")
    close(xg.grad, xr.grad, tol, "grad x")
    for name, p, q in zip(["router", "w13", "w2", "sh.w1", "sh.w3", "sh.w2"], ps, leaves):
        if name == "router" and m.args.norm_topk_prob:
            # a top-1 weight normalised over k = 1 is the constant routed_scaling_factor: the
            # router gradient is 0 up to rounding (s/(s+eps) in fp32), in the layer and the reference
            scale = m.experts.w13.grad.abs().max()
            assert p.grad.abs().max() <= 1e-6 * scale and q.grad.abs().max() <= 1e-12 * scale
        else:
            close(p.grad, q.grad, tol, f"grad {name}")
    others = [i for i in range(e) if i != target]
    assert torch.equal(m.experts.w13.grad[others], torch.zeros_like(m.experts.w13.grad[others]))
    assert torch.equal(m.experts.w2.grad[others], torch.zeros_like(m.experts.w2.grad[others]))


@pytest.mark.parametrize("gemm", ["torch", "loop"])
@pytest.mark.parametrize("A", [1, 128])
@pytest.mark.parametrize("norm", [True, False])
def test_five_tokens_one_expert(gemm, A, norm, close):
    m, x, gy = one_expert_layer(4, 0, gemm, A, 5, norm)
    run_one_expert(m, x, gy, reference_moe, close, 4, 0)


@pytest.mark.parametrize("gemm", ["torch", "loop"])
@pytest.mark.parametrize("A", [1, 128])
def test_4096_tokens_one_expert(gemm, A, ref_moe, close):
    m, x, gy = one_expert_layer(8, 5, gemm, A, 4096, norm=False, seed=8)
    run_one_expert(m, x, gy, ref_moe, close, 8, 5)
