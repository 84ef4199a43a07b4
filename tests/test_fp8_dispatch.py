"""FP8 dispatch (docs/design.md#fp8-dispatch): with ``gemm=fp8`` the ``a2a`` and ``agrs`` dispatchers move
e4m3 codes + scales of tokens quantised once, and FC1 multiplies the landed codes as they are.

FP8 is emulated on CPU (``Fp8Backend(emulate=True)``: the same codes and scales, dequantised,
one fp32 matmul per expert). A row's codes and scales depend on that row alone, so quantising
the tokens before the dispatch gives bit-for-bit the codes FC1 makes from the landed rows
without FP8 dispatch. Hence, on 2 and 4 gloo ranks against one process:

* against the same dispatcher at EP = 1 (the same FP8-dispatch arithmetic on the whole global
  batch): output and every gradient within ``TOL = 1e-5`` of the largest reference value — what
  remains is the fp32 summation order across ranks (the agrs reduce-scatter of partial sums,
  the router's gradient summed over ranks), as in tests/test_dispatch_equivalence.py;
* against ``local`` with ``gemm=fp8`` (today's single-rank FP8 path, rows quantised inside FC1):
  the same ``TOL`` for the output, ``dx``, the router's, shared experts' and ``dW2`` gradients
  (FC1's data gradient ``q(dY) @ q(W13ᵀ)`` never reads its input); ``dW13`` reads the dequantised
  codes instead of the rows (the rows never reach the expert's rank), so it differs by the
  input's FP8 rounding: within ``W13_TOL = 2⁻³`` of its largest value (e4m3 rounds a value by at
  most 2⁻⁴ of itself; measured here about 3 %), and a single-process test checks FC1's ``dW13``
  against the float64 product of the dequantised codes exactly.

Scenarios: alignment 1 and 8, folded weights, ``num_token_chunks = 3``, and every token routed
to rank 0's experts (the other ranks' experts are empty and they land no row). The byte
counters show the FP8 traffic: ``H + 4`` bytes per dispatched row (codes + one fp32 scale), the
combine and every backward transfer ``4·H`` (fp32 rows).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dropless.dispatch import build_dispatcher
from dropless.layout import ExpertLayout
from dropless.moe import MoE
from dropless.ops.fp8_backend import Fp8Backend
from dropless.ops.fp8_mlp import _Fp8FC1Landed
from dropless.ops.fp8_quant import FP8_DTYPE, dequant_rows
from dropless.ops.fp8_rows import Fp8Rows, RowQuantiser, grad_port
from tests import dist_harness as H
from tests.conftest import assert_scaled

TOL = 1e-5
W13_TOL = 2.0 ** -3
I_FP8 = 16  # FP8 rows need 16-byte multiples: moe_intermediate_size 16 (H is 16)

SCENARIOS = [
    dict(name=f"{d}-fp8-A{a}-{'fold' if f else 'nofold'}-{c}chunk{'-rank0only' if b else ''}", dispatcher=d,
         alignment=a, fold=f, biased=b, chunks=c, fp8=True, opts=dict(moe_intermediate_size=I_FP8))
    for d in ("a2a", "agrs")
    for (a, f, b, c) in ((1, False, False, 1), (8, True, False, 3), (8, False, True, 1))
]


def _args(sc):
    return H.model_args(expert_alignment=sc["alignment"], fold_routing_weights=sc["fold"],
                        num_token_chunks=sc["chunks"], moe_intermediate_size=I_FP8)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world_results(request):
    world = request.param
    return world, H.run_world("layer_worker", world, SCENARIOS, deadline_s=180)


@pytest.mark.slow
@pytest.mark.parametrize("sc", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_fp8_dispatch_equals_one_rank(world_results, sc):
    world, res = world_results
    same = H.reference(world, _args(sc), sc["biased"], dispatcher=sc["dispatcher"], fp8=True)
    today = H.reference(world, _args(sc), sc["biased"], dispatcher="local", fp8=True)
    for r in range(world):
        got = res[r][sc["name"]]
        sl = slice(r * H.SEQS_PER_RANK, (r + 1) * H.SEQS_PER_RANK)
        for ref, label in ((same, f"{sc['dispatcher']} EP=1"), (today, "local gemm=fp8")):
            where = f"{sc['name']} world={world} rank={r} vs {label}"
            assert torch.equal(got["w13"], ref["w13"]) and torch.equal(got["w2"], ref["w2"]), where
            assert_scaled(got["y"], ref["y"][sl], TOL, f"{where} y")
            assert_scaled(got["x_grad"], ref["x_grad"][sl], TOL, f"{where} dx")
            assert_scaled(got["router_grad"], ref["router_grad"], TOL, f"{where} d router.weight")
            assert_scaled(got["w2_grad"], ref["w2_grad"], TOL, f"{where} d w2")
            for name, a, b in zip(("w1", "w3", "w2"), got["shared_grads"], ref["shared_grads"]):
                assert_scaled(a, b, TOL, f"{where} d shared.{name}")
        assert_scaled(got["w13_grad"], same["w13_grad"], TOL, f"{sc['name']} world={world} rank={r} d w13")
        assert_scaled(got["w13_grad"], today["w13_grad"], W13_TOL, f"{sc['name']} rank={r} d w13 vs local")
    if sc["biased"]:  # the other ranks' experts are empty: exactly zero weight gradients
        e = 8 // world
        assert (same["w13_grad"][e:] == 0).all() and (res[1][sc["name"]]["w13_grad"][e:] == 0).all()
        assert all(res[r][sc["name"]]["rows_live"] == 0 for r in range(1, world))


def _rows_out_in(res, world, key, r):
    e = 8 // world
    owner = [res[s][key]["topk"] // e for s in range(world)]
    return int((owner[r] != r).sum()), sum(int((owner[s] == r).sum()) for s in range(world) if s != r)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["a2a-fp8-A1-nofold-1chunk", "a2a-fp8-A8-nofold-1chunk-rank0only"])
def test_a2a_fp8_dispatch_moves_codes_and_scales(world_results, key):
    """Dispatch: ``H`` code bytes + 4 scale bytes per row that leaves / enters the rank; combine and both
    backward transfers fp32 rows (``4·H``); the count matrix ``(EP−1)·e`` int32 each way."""
    world, res = world_results
    h, e = 16, 8 // world
    for r in range(world):
        got = res[r][key]
        n_out, n_in = _rows_out_in(res, world, key, r)
        counts = (world - 1) * e * 4
        fwd_sent = n_out * (h + 4) + n_in * 4 * h + counts
        fwd_recv = n_in * (h + 4) + n_out * 4 * h + counts
        assert got["fwd_bytes"] == {"bytes_sent": fwd_sent, "bytes_received": fwd_recv}, (r, got["fwd_bytes"])
        bwd = (n_out + n_in) * 4 * h
        assert got["step_bytes"] == {"bytes_sent": fwd_sent + bwd, "bytes_received": fwd_recv + bwd}


@pytest.mark.slow
def test_agrs_fp8_dispatch_moves_codes_and_scales(world_results):
    """All-gather of ``T`` codes rows + scales ``(EP−1)·T·(H + 4)``, instead of ``(EP−1)·T·4H``."""
    world, res = world_results
    t, h, k = H.SEQS_PER_RANK * H.SEQ_LEN, 16, 2
    fwd = (world - 1) * t * ((h + 4) + 4 * h + k * (8 + 4))
    step = fwd + (world - 1) * t * (2 * 4 * h + k * 4)
    for r in range(world):
        got = res[r]["agrs-fp8-A1-nofold-1chunk"]
        assert got["fwd_bytes"] == {"bytes_sent": fwd, "bytes_received": fwd}
        assert got["step_bytes"] == {"bytes_sent": step, "bytes_received": step}


# ---------------------------------------------------------------------------- one process
def _routing(t, k, e, g):
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    idx[0] = -1  # a dropped token (capacity baseline): never dispatched
    idx[1, 0] = -1
    return idx, torch.rand(t, k, generator=g)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("name", ["a2a", "agrs"])
def test_dispatch_lands_the_codes_fc1_would_make(name, ue8m0):
    """The FP8-landed codes and scales equal FC1's quantisation of the compute-dtype landed rows, bit for
    bit, on the live rows (power-of-two scales too); the send side is 1-byte codes; ``rows_MH`` is a
    zero-stride port."""
    g = torch.Generator().manual_seed(5)
    be = Fp8Backend(emulate=True, ue8m0=ue8m0)
    t, h, e, k = 10, 32, 4, 2
    x = torch.randn(t, h, generator=g) * torch.logspace(-3, 2, t).unsqueeze(1)  # rows of very different size
    idx, w = _routing(t, k, e, g)
    idx[:, :] = torch.where(idx == 3, -1, idx)  # expert 3 empty
    disp = build_dispatcher(name, H.model_args(n_routed_experts=e, n_group=1, topk_group=1), None)
    quant = RowQuantiser(lambda a: be.quant_act(a, None), torch.float32)
    codes_u8, scales, rowwise = quant(x)
    assert codes_u8.dtype == torch.uint8 and codes_u8.shape == (t, h) and scales.shape == (t, 1) and rowwise
    plain = disp.dispatch(x, idx, w, alignment=8)
    fp8 = disp.dispatch(x, idx, w, alignment=8, quant=quant)
    assert plain.fp8 is None and fp8.fp8.codes_MH.dtype == FP8_DTYPE
    assert fp8.rows_MH.shape == plain.rows_MH.shape and fp8.rows_MH.stride() == (0, 0)
    live = plain.layout.live_mask()
    assert int(plain.layout.counts[3]) == 0 and int(live.sum()) == int((idx >= 0).sum())
    q_ref, s_ref = be.quant_act(plain.rows_MH, plain.layout)
    assert torch.equal(fp8.fp8.codes_MH.view(torch.uint8)[live], q_ref.view(torch.uint8)[live])
    assert torch.equal(fp8.fp8.scales[live], s_ref[live])


def test_fc1_on_landed_codes_forward_and_gradients():
    """FC1 of FP8-landed rows: ``h13`` is today's FP8 FC1 of the rows bit for bit; the port's gradient is
    today's ``dX`` bit for bit; ``dW13[i] = Σ_live deq(codes)ᵀ · dh13`` (float64 reference), 0 for an
    empty expert."""
    g = torch.Generator().manual_seed(7)
    be = Fp8Backend(emulate=True)
    counts, h, n2 = [5, 0, 7], 32, 48
    lay = ExpertLayout.from_counts(torch.tensor(counts), alignment=8, num_rows=sum(counts))
    live = lay.live_mask()
    x = torch.randn(lay.capacity, h, generator=g)
    x[~live] = float("nan")  # padding rows are never read
    w13 = (torch.randn(len(counts), h, n2, generator=g) * 0.1).requires_grad_()
    q, s = be.quant_act(x, lay)
    x_ref = x.clone().requires_grad_()
    h_ref = be.gmm(x_ref, w13, lay)
    port = grad_port(x_ref.new_zeros(1, h).requires_grad_(), lay.capacity, torch.float32, lambda gr: lambda: gr[:1])
    h13 = _Fp8FC1Landed.apply(port, w13, q, s, lay, be, None)
    assert torch.equal(h13[live], h_ref[live])
    dh = torch.randn(h13.shape, generator=g)
    dport, dw13 = torch.autograd.grad(h13, (port, w13), dh)
    assert torch.equal(dport[live], be.gmm(dh, w13.detach().transpose(1, 2), lay)[live])
    deq = dequant_rows(q, s).double()
    for i, (st, en) in enumerate(zip(lay.start.tolist(), lay.end.tolist())):
        want = deq[st:en].t() @ dh[st:en].double()
        assert_scaled(dw13[i], want, 1e-6, f"dW13[{i}]") if en > st else None
    assert torch.equal(dw13[1], torch.zeros_like(dw13[1]))


def _fp8_moe(dispatcher, **over):
    args = H.model_args(moe_intermediate_size=I_FP8, expert_alignment=8, gemm="fp8", **over)
    m = MoE(args, H.LAYER_ID, build_dispatcher(dispatcher, args, None))
    m.init_weights()
    m.experts.backend = Fp8Backend(emulate=True)
    return m


def _run(m):
    x, cot = H.global_batch(1, m.args)
    x = x.clone().requires_grad_()
    y = m(x)
    (y * cot).sum().backward()
    return y.detach(), x.grad, m.experts.w13.grad


def test_no_fp8_dispatch_where_fc1_quantises_itself_and_it_says_so():
    """recompute_fc1 (FC1 rebuilt from the rows in backward) cannot take dispatched codes: a2a then moves rows,
    says so once at construction, and gives today's gemm=fp8 values exactly (dW13 included)."""
    with pytest.warns(UserWarning, match="recompute_fc1") as rec:
        m = _fp8_moe("a2a", recompute_fc1=True)
    assert any("dispatcher=a2a" in str(w.message) for w in rec)
    assert m._row_quantiser(torch.float32) is None
    ref = _fp8_moe("local", recompute_fc1=True)
    for a, b in zip(_run(m), _run(ref)):
        assert torch.equal(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note where FP8 dispatch runs
        m2 = _fp8_moe("a2a")
    assert m2._row_quantiser(torch.float32) is not None


def test_fp8_dispatch_deep_gemm_1x128_scales():
    """gemm=deep_gemm (CPU stand-in): the tokens travel with 1×128 scales ``[T, H/128]``; the layer's output
    and dx equal ``local``'s bit for bit at EP = 1."""
    from dropless.ops.deep_gemm_backend import DeepGemmBackend
    from tests import fake_deep_gemm

    res = {}
    for name in ("local", "a2a"):
        args = H.model_args(hidden_size=128, moe_intermediate_size=128, expert_alignment=128)
        m = MoE(args, H.LAYER_ID, build_dispatcher(name, args, None))
        m.init_weights()
        m.experts.backend = DeepGemmBackend(module=fake_deep_gemm, emulate=True)
        q = m._row_quantiser(torch.float32)
        if name == "a2a":  # one 1x128 block per row at H = 128: scales [T, 1], not the rowwise [T]
            _, s, rowwise = q(torch.randn(3, 128))
            assert s.shape == (3, 1) and not rowwise
        res[name] = _run(m)
    assert torch.equal(res["a2a"][0], res["local"][0]) and torch.equal(res["a2a"][1], res["local"][1])


def test_fp8_rows_reject_a_non_fp8_path():
    m = _fp8_moe("a2a", poison_padding=True)
    assert not m.experts.takes_fp8_rows
    lay = ExpertLayout.from_counts(torch.tensor([1] * 8), alignment=1, num_rows=8)
    rows = Fp8Rows(torch.zeros(8, 16, dtype=FP8_DTYPE), torch.ones(8))
    with pytest.raises(ValueError, match="FP8"):
        m.experts(torch.zeros(8, 16), lay, fp8_rows=rows)
