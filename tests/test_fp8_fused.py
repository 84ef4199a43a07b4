"""FP8 quantisation fused into the row kernels (dropless/ops/fp8_fused_rows.py): the local gather that lands
FC1's rows and the combine's backward that writes FC2's output gradient write the e4m3 codes and scales too.

The codes and scales must be those of fp8_quant's quantiser on the unfused kernel's output, bit for
bit, on every live row: the torch reference against the torch quantiser, the Triton kernel against
the Triton quantiser (on CUDA, or on the CPU under Triton's interpreter, ``TRITON_INTERPRET=1``:
its e4m3 conversion does not round to nearest, so there the Triton codes are compared with the
Triton quantiser's only; the scales with the torch reference's too). The MoE layer with
``gemm=fp8`` (emulated on CPU) gives bit for bit the values of the separate quantisation passes
(``Fp8Backend(fused_quant=False)``), with two of its three activation quantisation passes gone.
"""

from __future__ import annotations

import os
import weakref

import pytest
import torch

from dropless.dispatch import build_dispatcher
from dropless.dispatch.local import LocalDispatcher
from dropless.experts import GroupedExperts
from dropless.moe import MoE
from dropless.ops import fp8_fused_rows as ff
from dropless.ops import fp8_mlp, select
from dropless.ops import rows as rw
from dropless.ops.deep_gemm_backend import DeepGemmBackend
from dropless.ops.fp8_backend import Fp8Backend
from dropless.ops.fp8_mlp import fp8_expert_mlp
from dropless.ops.fp8_quant import _quant_torch, quant_rows
from dropless.ops.fp8_rows import RowQuantiser, permute_fp8
from dropless.permute import sort_by_expert
from dropless.saved_bytes import SavedBytes
from tests import dist_harness as H
from tests import fake_deep_gemm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = select.HAS_TRITON and (DEV == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
PATHS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not TRITON_HERE, reason="no CUDA and Triton's interpreter is off (.ci/run runs this file under it)"))]
SENTINEL = 0x5A  # a code byte no kernel writes to padding rows (checked on the Triton path)


@pytest.fixture
def path(request, monkeypatch):
    monkeypatch.setattr(select, "FORCE_TRITON", request.param == "triton")
    return request.param


def _routing(n, k, e, alignment, seed=0):
    """Tokens of very different sizes, a zero token, an empty expert, a dropped choice, a token landed nowhere."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    idx[idx == 2] = -1  # expert 2 empty
    idx[3, 0] = -1
    idx[7, :] = -1  # token 7 lands nowhere
    lay, dest, src = sort_by_expert(idx.to(DEV), e, alignment)
    return lay, dest, src


def _tokens(n, h, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * torch.logspace(-4, 3, n).unsqueeze(1)
    x[5] = 0.0  # amax 0: scale 1e-12 / 448, zero codes
    x[7] = float("nan")  # landed nowhere: never checked, never read
    return x.to(DEV, dtype)


def _assert_dots_close(gw_Nk, g_NH, y_MH, dest_Nk):
    """``gw[n, j] = g[n] · y[dest[n, j]]`` (0 where ``dest < 0``) against the float64 dot, within the bound of an fp32
    sum of ``H`` terms in any order (``H · (2^-24 · Σ|terms| + 2^-126)``, the last for products below fp32's normal
    range that a GPU may flush to zero): rows.py's and fp8_fused_rows.py's kernels sum the same blocks, but the
    compiled fp32 sums may round differently in the last bits; NaN exactly where the float64 dot is NaN."""
    g64, y64 = g_NH.double(), y_MH.double()
    terms = torch.where((dest_Nk >= 0).unsqueeze(2), g64.unsqueeze(1) * y64[dest_Nk.clamp(min=0)], 0.0)
    ref = terms.sum(2)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(gw_Nk), nan)
    bound = g_NH.shape[1] * (2.0**-24 * terms.abs().sum(2) + 2.0**-126)  # + products below fp32's normals, flushed
    assert bool(((gw_Nk.double() - ref).abs() <= bound)[~nan].all())


def _same_codes(a, b, live):
    return torch.equal(a.view(torch.uint8)[live], b.view(torch.uint8)[live])


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("group", [0, 128])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_quant_rows_equals_quantising_the_landed_rows(path, group, ue8m0, dtype):
    """Rows as ``land_rows``; codes and scales as ``quant_rows`` of the landed rows on live rows, bit for bit;
    the scales equal the torch reference's on either path; H = 384 is not a power of two."""
    n, k, e, h = 40, 3, 6, 384
    lay, dest, src = _routing(n, k, e, alignment=8)
    x = _tokens(n, h, dtype)
    live = lay.live_mask()
    assert int(lay.counts[2]) == 0 and bool((~live).any())
    rows, q, s = ff.scatter_quant_rows(x, src, dest, group, ue8m0)
    ref = rw.land_rows(x, src, dest)
    q_ref, s_ref = quant_rows(ref, lay, ue8m0, group=group)
    assert torch.equal(rows[live], ref[live])
    assert _same_codes(q, q_ref, live) and torch.equal(s[live], s_ref[live])
    a = torch.where(live.unsqueeze(1), ref.float(), 0.0)
    q_t, s_t, _ = _quant_torch(a, ue8m0, group)
    assert torch.equal(s[live], s_t[live])
    if path == "torch" or DEV == "cuda":  # the interpreter's e4m3 conversion does not round to nearest
        assert _same_codes(q, q_t, live)
    zero = live & (src == 5)  # the zero token's rows: the floor scale and zero codes
    assert bool(zero.any()) and (q.view(torch.uint8)[zero] == 0).all()
    assert torch.equal(s[zero], torch.full_like(s[zero], s_t[zero].flatten()[0].item()))
    rows2, q2, s2 = ff.scatter_quant_rows(x, src, dest, group, ue8m0, keep_rows=False)
    assert rows2 is None and _same_codes(q2, q, live) and torch.equal(s2[live], s[live])


def _signed_weights(n, k, seed):
    """Routing weights of both signs and many magnitudes: +0, -0, bf16-exact values (their products with bf16
    gradients often fall exactly halfway between two bf16 values), fp32 values of full precision."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-6, 7, (n, k), generator=g).float())
    w[::2] = w[::2].to(torch.bfloat16).float()
    w[1, 0], w[2, :] = 0.0, -0.0
    return w.to(DEV)


def _hard_grads(n, h, dtype, seed):
    """``_tokens`` plus a token of subnormal magnitudes (bf16/fp32) and a token of equal magnitudes (every column
    ties for the amax)."""
    g = _tokens(n, h, dtype, seed=seed)
    tiny = torch.finfo(dtype).tiny
    g[9] = (torch.randn(h, generator=torch.Generator().manual_seed(seed)) * tiny * 4).to(DEV, dtype)
    g[10] = torch.where(torch.arange(h, device=DEV) % 3 == 0, -1.5, 1.5).to(dtype)
    return g


def test_row_amax_is_the_token_amax_times_the_weight():
    """The identity combine_bwd_quant's scales rest on: ``max_c |(g_c · w).to(dt)| == (max_c |g_c| · |w|).to(dt)``
    bit for bit (fp32 product, one rounding to the rows' dtype), for weights of both signs and zero, over
    20,000 rows per dtype holding exact rounding ties, subnormal products, products that overflow to inf, and
    all-zero rows (each kind present, counted below)."""
    gen = torch.Generator().manual_seed(0)
    r, c = 20000, 64
    for dt, (lo, hi) in {torch.bfloat16: (-140, 127), torch.float16: (-30, 16), torch.float32: (-150, 127)}.items():
        e = torch.randint(lo, hi, (r, 1), generator=gen).float()
        g = (torch.randn(r, c, generator=gen) * torch.exp2(e)).clamp(-torch.finfo(dt).max, torch.finfo(dt).max)
        g = g.to(dt)
        g[::97] = 0.0
        w = torch.randn(r, generator=gen) * torch.exp2(torch.randint(-6, 7, (r,), generator=gen).float())
        w[::2] = w[::2].to(torch.bfloat16).float()  # few mantissa bits: exact products, many ties
        w[::7], w[1::7] = 0.0, -0.0
        prod = g.float() * w.unsqueeze(1)
        rows = prod.to(dt).float()
        row_amax = rows.abs().amax(1)
        from_token = (g.float().abs().amax(1) * w.abs()).to(dt).float()
        assert torch.equal(row_amax, from_token), dt
        finfo = torch.finfo(dt)
        assert bool(torch.isinf(row_amax).any()) and bool((row_amax == 0).any())
        assert bool(((prod.abs() < finfo.tiny) & (prod != 0)).any())  # subnormal (or flushed) products
        # a tie: the product lies exactly halfway between its rounding and the next value beyond it
        beyond = torch.nextafter(prod.to(dt), torch.where(prod > rows, torch.inf, -torch.inf).to(dt)).double()
        ties = (prod != rows) & (2 * prod.double() == rows.double() + beyond)
        assert dt == torch.float32 or bool(ties.any()), dt  # fp32 rows: the product is the row, no rounding


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("group", [0, 128])
@pytest.mark.parametrize("weighted,need_gw", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_combine_bwd_quant_equals_quantising_the_gradient_rows(path, group, weighted, need_gw, ue8m0, dt):
    """``grad_y`` as ``combine_bwd``'s, bit for bit; ``grad_w`` and ``combine_bwd``'s each the float64 dot within
    the fp32 sum's bound (0 for a choice landed nowhere); codes and scales as ``quant_rows`` of ``grad_y`` on live
    rows, bit for bit (quantised from the rows as rounded to their dtype), with weights of both signs and zero,
    a zero token, a token of subnormal magnitudes, one whose columns tie for the amax, an empty expert."""
    n, k, e, h = 40, 3, 6, 384
    lay, dest, src = _routing(n, k, e, alignment=8, seed=2)
    m, live = lay.capacity, lay.live_mask()
    assert int(lay.counts[2]) == 0
    g = _hard_grads(n, h, dt, seed=3)
    g[7] = float("nan")  # token 7 landed nowhere: its gradient row is never read
    w = _signed_weights(n, k, seed=4) if weighted else None
    y = torch.randn(m, h, generator=torch.Generator().manual_seed(5)).to(DEV, dt)
    y[~live] = float("nan")
    gy, gw, q, s = ff.combine_bwd_quant(g, y, dest, w, m, need_gw, group, ue8m0)
    gy0, gw0 = rw.combine_bwd(g, y, dest, w, m, need_gw)
    assert torch.equal(gy[live], gy0[live])
    assert (gw is None) == (gw0 is None)
    if gw is not None:  # token 7 landed nowhere: 0, its NaN gradient never read
        _assert_dots_close(gw, g, y, dest)
        _assert_dots_close(gw0, g, y, dest)
    q_ref, s_ref = quant_rows(gy0, lay, ue8m0, group=group)
    assert _same_codes(q, q_ref, live) and torch.equal(s[live], s_ref[live])
    _, s_t, _ = _quant_torch(torch.where(live.unsqueeze(1), gy0.float(), 0.0), ue8m0, group)
    assert torch.equal(s[live], s_t[live])
    for tok in (5, 9, 10):  # the zero, subnormal and tied tokens reach live rows
        assert bool((live & (src == tok)).any())


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("group", [0, 128])
def test_nonfinite_live_row_raises_and_a_row_landed_nowhere_does_not(path, group):
    """A NaN / Inf in a landed token or a live gradient row raises fp8_quant's error (it names gemm=fp8); the
    token landed nowhere holds NaN in every test above and raised nothing. On CUDA the kernels' flag is
    checked instead (the device-side assert would end the process's CUDA context)."""
    n, k, e, h = 40, 3, 6, 256
    lay, dest, src = _routing(n, k, e, alignment=1)
    m = lay.capacity
    x = _tokens(n, h, torch.float32)
    live_tok = int(src[lay.live_mask()][0])
    for bad in (float("nan"), float("inf")):
        x2 = x.clone()
        x2[live_tok, 130] = bad
        if DEV == "cuda":
            q = torch.empty(m, h, dtype=ff.FP8_DTYPE, device=DEV)
            s = torch.empty((m, h // 128) if group else (m,), device=DEV)
            for launch in (lambda f: ff._scatter_quant_launch(x2, dest.contiguous(), None, q, s, f, group, False),
                           lambda f: ff._combine_quant_launch(x2, None, dest.contiguous(), None, x2.new_empty(m, h),
                                                              None, q, s, f, group, False)):
                flag = torch.zeros(1, dtype=torch.int32, device=DEV)
                launch(flag)
                assert int(flag) > 0
            continue
        with pytest.raises(RuntimeError, match="gemm=fp8.*NaN or Inf"):
            ff.scatter_quant_rows(x2, src, dest, group)
        with pytest.raises(RuntimeError, match="gemm=fp8.*NaN or Inf"):
            ff.combine_bwd_quant(x2, None, dest, None, m, False, group)
    # finite gradients and weights whose product overflows: the row holds Inf (its amax does too)
    w = torch.ones(n, k, device=DEV)
    w[live_tok] = -1e30
    x3 = x.clone()
    x3[live_tok, 200] = 1e10
    if DEV == "cuda":
        flag = torch.zeros(1, dtype=torch.int32, device=DEV)
        q = torch.empty(m, h, dtype=ff.FP8_DTYPE, device=DEV)
        s = torch.empty((m, h // 128) if group else (m,), device=DEV)
        ff._combine_quant_launch(x3, None, dest.contiguous(), w, x3.new_empty(m, h), None, q, s, flag, group, False)
        assert int(flag) > 0
    else:
        with pytest.raises(RuntimeError, match="gemm=fp8.*NaN or Inf"):
            ff.combine_bwd_quant(x3, None, dest, w, m, False, group)
    ff.combine_bwd_quant(x3, None, dest, torch.ones(n, k, device=DEV), m, False, group)  # finite: no error


@pytest.mark.skipif(not TRITON_HERE, reason="no CUDA and Triton's interpreter is off")
@pytest.mark.parametrize("group", [0, 128])
def test_kernels_leave_padding_rows_unwritten(group, monkeypatch):
    """The Triton kernels write live rows only: padding rows of the rows, codes and scales keep their sentinel."""
    monkeypatch.setattr(select, "FORCE_TRITON", True)
    n, k, e, h = 40, 3, 6, 256
    lay, dest, src = _routing(n, k, e, alignment=16)
    m, pad = lay.capacity, ~lay.live_mask()
    x = _tokens(n, h, torch.bfloat16)
    rows = torch.full((m, h), 7.0, dtype=x.dtype, device=DEV)
    q = torch.full((m, h), SENTINEL, dtype=torch.uint8, device=DEV).view(ff.FP8_DTYPE)
    shape = (m, h // 128) if group else (m,)
    s = torch.full(shape, -1.0, device=DEV)
    flag = torch.zeros(1, dtype=torch.int32, device=DEV)
    ff._scatter_quant_launch(x, dest.contiguous(), rows, q, s, flag, group, False)
    assert bool(pad.any()) and (rows[pad] == 7.0).all() and (q.view(torch.uint8)[pad] == SENTINEL).all()
    assert (s[pad] == -1.0).all() and int(flag) == 0
    gy = torch.full((m, h), 7.0, dtype=x.dtype, device=DEV)
    q.view(torch.uint8).fill_(SENTINEL)
    s.fill_(-1.0)
    ff._combine_quant_launch(x, None, dest.contiguous(), None, gy, None, q, s, flag, group, False)
    assert int(flag) == 0  # token 7 (NaN) lands nowhere
    assert (gy[pad] == 7.0).all() and (q.view(torch.uint8)[pad] == SENTINEL).all() and (s[pad] == -1.0).all()


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_empty_inputs(path):
    """No tokens, or every choice dropped: empty / all-padding outputs, no error."""
    for idx in (torch.zeros(0, 2, dtype=torch.int64), torch.full((4, 2), -1)):
        lay, dest, src = sort_by_expert(idx.to(DEV), 3, 8)
        x = torch.randn(idx.shape[0], 128, device=DEV)
        rows, q, s = ff.scatter_quant_rows(x, src, dest, 128)
        assert q.shape == (lay.capacity, 128) and s.shape == (lay.capacity, 1) and rows.shape == q.shape
        gy, gw, q, s = ff.combine_bwd_quant(x, None, dest, None, lay.capacity, False, 0)
        assert gy.shape == (lay.capacity, 128) and s.shape == (lay.capacity,) and gw is None


def test_permute_fp8_gradient_and_no_grad_placeholder():
    """permute_fp8's rows carry permute_rows' gradient (the tokens' gradient is the sum over their rows); without
    autograd no rows are written (a zero-stride placeholder) and the codes are the same."""
    n, k, e, h = 12, 2, 4, 32
    lay, dest, src = _routing(n, k, e, alignment=4)
    x = _tokens(n, h, torch.float32)
    x[7] = 1.0
    x.requires_grad_()
    quant = RowQuantiser(lambda a: quant_rows(a), torch.float32, group=0)
    rows, fp8 = permute_fp8(x, src, dest, quant)
    assert fp8.rows_kept
    gr = torch.randn(rows.shape, device=DEV)
    (gx,) = torch.autograd.grad(rows, x, gr)
    assert torch.equal(gx, rw.gather_sum(gr, dest, None))
    with torch.no_grad():
        rows0, fp80 = permute_fp8(x, src, dest, quant)
    live = lay.live_mask()
    assert rows0.stride() == (0, 0) and not fp80.rows_kept
    assert _same_codes(fp80.codes_MH, fp8.codes_MH, live) and torch.equal(fp80.scales[live], fp8.scales[live])
    with pytest.raises(ValueError, match="group"):
        permute_fp8(x, src, dest, RowQuantiser(quant.quant, torch.float32))


def _moe(dispatcher, backend, **over):
    args = H.model_args(moe_intermediate_size=128 if isinstance(backend, DeepGemmBackend) else 16, gemm="fp8",
                        **over)
    m = MoE(args, H.LAYER_ID, build_dispatcher(dispatcher, args, None))
    m.init_weights()
    m.experts.backend = backend
    return m


def _run(m, no_grad=False):
    x, cot = H.global_batch(1, m.args)
    dev = m.experts.w13.device
    x, cot = x[..., :m.args.hidden_size].to(dev).requires_grad_(), cot.to(dev)
    if no_grad:
        with torch.no_grad():
            return (m(x),)
    y = m(x)
    (y * cot[..., :m.args.hidden_size]).sum().backward()
    grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    return [y.detach(), x.grad] + grads


SCENARIOS = [
    dict(expert_alignment=1),
    dict(expert_alignment=8, fold_routing_weights=True),
    dict(expert_alignment=8, num_token_chunks=3),
]


@pytest.mark.parametrize("over", SCENARIOS, ids=["A1", "A8-fold", "A8-3chunks"])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("dispatcher", ["local", "a2a"])
def test_moe_layer_fused_equals_separate_passes(over, ue8m0, dispatcher, monkeypatch):
    """The MoE layer with gemm=fp8 (emulated): output and every gradient bit for bit equal with and without the
    fused quantisation; fused, the activations go through quant_act once per chunk (FC1's output gradient),
    not three times (FC1's rows, FC2's output gradient too). a2a (EP = 1 here) dispatches FP8 either way (its
    tokens quantised before they are sent): only FC2's output gradient changes path."""
    calls = {"n": 0}
    real = Fp8Backend.quant_act

    def counting(self, x, layout):
        calls["n"] += 1
        return real(self, x, layout)

    monkeypatch.setattr(Fp8Backend, "quant_act", counting)
    res = {}
    for fused in (False, True):
        calls["n"] = 0
        m = _moe(dispatcher, Fp8Backend(emulate=True, ue8m0=ue8m0, fused_quant=fused), **over)
        res[fused] = _run(m)
        res[fused, "calls"] = calls["n"]
    chunks = over.get("num_token_chunks", 1)
    fused_calls = 1 if dispatcher == "local" else 2  # a2a quantises the tokens before it sends them
    assert res[False, "calls"] == 3 * chunks and res[True, "calls"] == fused_calls * chunks
    assert len(res[True]) == len(res[False]) >= 6
    for a, b in zip(res[True], res[False]):
        assert torch.equal(a, b)


def test_moe_layer_fused_deep_gemm_1x128_and_no_grad():
    """gemm=deep_gemm (CPU stand-in, 1x128 scales): the fused layer equals the separate passes bit for bit;
    under no_grad the local gather writes codes only and the output is the same."""
    res = {}
    for fused in (False, True):
        be = DeepGemmBackend(module=fake_deep_gemm, emulate=True, fused_quant=fused)
        m = _moe("local", be, hidden_size=128, expert_alignment=128)
        res[fused] = _run(m)
        res[fused, "ng"] = _run(m, no_grad=True)
    for a, b in zip(res[True], res[False]):
        assert torch.equal(a, b)
    assert torch.equal(res[True, "ng"][0], res[False][0])


def test_recompute_paths_quantise_themselves():
    """recompute_gather / recompute_fc1: the local gather lands no codes (the fused node lands the codes from the
    rows' source itself; the recompute nodes quantise the rows they rebuild)."""
    for over in (dict(recompute_gather=True), dict(recompute_fc1=True)):
        m = _moe("local", Fp8Backend(emulate=True, fused_quant=True), **over)
        assert m._row_quantiser(torch.float32) is None
    m = _moe("local", Fp8Backend(emulate=True, fused_quant=True))
    assert m._row_quantiser(torch.float32).group == 0
    assert _moe("local", Fp8Backend(emulate=True, fused_quant=False))._row_quantiser(torch.float32).group is None


@pytest.mark.parametrize("over", SCENARIOS, ids=["A1", "A8-fold", "A8-3chunks"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_recompute_gather_equals_the_landed_rows(over, fused, monkeypatch):
    """gemm=fp8 (emulated) with recompute_gather: FC1 lands the codes from the tokens itself and lands the rows
    again for dW13; output and every gradient bit for bit those of the same layer with the rows landed and
    saved. Fused, the landing kernel writes the codes (no quantisation pass over FC1's rows: quant_act runs
    for FC1's output gradient only, once per chunk), and no compute-dtype copy of the rows is landed in forward."""
    calls = {"quant": 0, "land": 0}
    real_quant, real_land = Fp8Backend.quant_act, fp8_mlp.land_rows

    def counting(self, x, layout):
        calls["quant"] += 1
        return real_quant(self, x, layout)

    def landing(*a):
        calls["land"] += 1
        return real_land(*a)

    monkeypatch.setattr(Fp8Backend, "quant_act", counting)
    monkeypatch.setattr(fp8_mlp, "land_rows", landing)
    res = {}
    for gather in (False, True):
        calls.update(quant=0, land=0)
        m = _moe("local", Fp8Backend(emulate=True, fused_quant=fused), recompute_gather=gather, **over)
        assert m.experts.gathers is gather
        res[gather] = _run(m)
        res[gather, "calls"] = dict(calls)
    chunks = over.get("num_token_chunks", 1)
    assert res[True, "calls"] == dict(quant=(1 if fused else 3) * chunks, land=(1 if fused else 2) * chunks)
    assert len(res[True]) == len(res[False]) >= 6
    for a, b in zip(res[True], res[False]):
        assert torch.equal(a, b)


def test_recompute_gather_saves_what_the_bf16_recompute_nodes_save():
    """The FP8 node with recompute_gather saves the recompute nodes' tensors (h13, the indices; no landed rows,
    no SwiGLU output): the same bytes as gemm=torch with recompute_gather."""
    t, h, i, e, k = 64, 32, 16, 8, 2
    got, m = {}, t * k
    for name, gemm in (("torch", "torch"), ("fp8", Fp8Backend(emulate=True))):
        ex = GroupedExperts(h, i, e, gemm=gemm, recompute_gather=True)
        ex.init_weights(0, 0)
        x = torch.randn(t, h, requires_grad=True)
        idx = torch.randint(0, e, (t, k), generator=torch.Generator().manual_seed(1))
        d = LocalDispatcher(e).dispatch_source(x, idx, torch.rand(t, k))
        with SavedBytes([*ex.parameters(), x]) as sb:
            y = ex(None, d.layout, source=d.source)
        y.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        got[name] = sb.total()
    # fp32 h13 [M, 2I], int64 src_M (M + 1 slots) and dest_Nk [T, k]
    assert got["fp8"] == got["torch"] == 4 * m * 2 * i + 8 * (m + 1) + 8 * t * k


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dispatcher,fold", [("local", False), ("local", True), ("a2a", False)],
                         ids=["weights-in-combine", "folded", "a2a"])
def test_moe_layer_fused_equals_separate_passes_kernel_path(path, dispatcher, fold):
    """The same equality with every op on its Triton kernel (CUDA, or the CPU interpreter): the fused kernels'
    codes feed the emulated GEMMs in place of the Triton quantiser's, and the combine's weight gradient is
    rows.py's bit for bit. a2a: FC2's rows come back to the tokens by a one-choice combine without weights
    (the combine's backward without a weight gradient, its wider blocks)."""
    res = {}
    for fused in (False, True):
        m = _moe(dispatcher, Fp8Backend(emulate=True, fused_quant=fused), expert_alignment=8,
                 fold_routing_weights=fold)
        res[fused] = _run(m.to(DEV))
    for a, b in zip(res[True], res[False]):
        assert torch.equal(a, b)


def test_landed_codes_freed_after_fc1():
    """The local gather's codes are handed to FC1 once and nothing keeps them afterwards (FC1 saves the bf16 rows
    for dW13): they do not stay alive through FC2 and the backward; a second hand-over is an error."""
    n, k, e, h, i = 24, 2, 4, 32, 16
    lay, dest, src = _routing(n, k, e, alignment=8)
    x = _tokens(n, h, torch.float32)
    x[7] = 1.0
    x.requires_grad_()
    be = Fp8Backend(emulate=True, fused_quant=True)
    rows, fp8 = permute_fp8(x, src, dest, RowQuantiser(lambda a: be.quant_act(a, None), torch.float32, group=0))
    alive = weakref.ref(fp8.codes_MH)
    g = torch.Generator().manual_seed(3)
    w13 = (torch.randn(e, h, 2 * i, generator=g) * 0.1).to(DEV).requires_grad_()
    w2 = (torch.randn(e, i, h, generator=g) * 0.1).to(DEV).requires_grad_()
    y = fp8_expert_mlp(rows, w13, w2, None, lay, be, landed=fp8)
    assert fp8.codes_MH is None and alive() is None
    y[lay.live_mask()].sum().backward()
    assert x.grad is not None and torch.isfinite(w13.grad).all()
    with pytest.raises(ValueError, match="codes"):
        fp8.release()
