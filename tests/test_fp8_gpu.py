"""``gemm=fp8`` on a CUDA GPU with FP8 tensor cores: the Triton quant kernels, the real scaled grouped GEMM.

The real kernel is checked against the emulation (the same FP8 operands dequantised, fp32
GEMM: they differ by the fp32 summation order and the bf16 rounding of the output, bound
1e-2 relative) and against float64 of the unquantised operands (the FP8 error, bound 0.06 per
GEMM; see tests/test_fp8.py). Each test prints the relative errors it measured.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dropless import ModelArgs
from dropless.experts import GroupedExperts
from dropless.layout import ExpertLayout
from dropless.moe import MoE
from dropless.ops import grouped_mm
from dropless.ops.fp8_backend import Fp8Backend, fp8_unavailable_reason
from dropless.ops.fp8_quant import FP8_MAX, _quant_torch, dequant_rows, quant_rows, quant_weight, swiglu_quant_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(fp8_unavailable_reason("cuda") is not None, reason="needs CUDA with cc >= 8.9")]

NAN = float("nan")


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def make(counts, a, k_dim, n_dim, seed=0):
    lay = ExpertLayout.from_counts(torch.tensor(counts, device="cuda"), alignment=a,
                                   num_rows=sum(counts))
    g = torch.Generator(device="cuda").manual_seed(seed)
    live = lay.live_mask()
    x = torch.randn(lay.capacity, k_dim, device="cuda", generator=g).bfloat16()
    x[~live] = NAN
    w = (torch.randn(len(counts), k_dim, n_dim, device="cuda", generator=g) / k_dim ** 0.5).bfloat16()
    return lay, x, w, live, g


def segments(lay):
    return list(zip(lay.start.tolist(), lay.end.tolist()))


def test_triton_quant_kernels_match_reference():
    lay, x, _, live, _ = make([300, 0, 1000, 77], 128, 7168, 16)
    x[live] *= torch.logspace(-3, 3, int(live.sum()), device="cuda").unsqueeze(1).bfloat16()
    q, s = quant_rows(x, lay)
    qr, sr, _ = _quant_torch(x[live].float(), False)
    assert torch.equal(s[live], sr)
    assert torch.equal(q[live].float(), qr.float())
    h13 = x[:, :4096].contiguous()
    q2, s2 = swiglu_quant_rows(h13, lay)
    a = torch.nn.functional.silu(h13[live, :2048].double()) * h13[live, 2048:].double()
    torch.testing.assert_close(s2[live].double(), a.abs().amax(1) / FP8_MAX, rtol=1e-5, atol=0)
    err = (dequant_rows(q2[live], s2[live]).double() - a).abs()
    assert (err <= 2.0 ** -4 * a.abs() * 1.001 + 2.0 ** -10 * s2[live].double().unsqueeze(1)).all()


@pytest.mark.parametrize("k_dim", [512, 1024, 2048])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_triton_quant_small_rows_and_weights_match_reference(k_dim, ue8m0):
    """The multi-row blocks (K <= 2048: 4-16 rows per block) and the weight copies made through the
    row kernel equal the torch reference bit for bit."""
    lay, x, _, live, _ = make([3000, 0, 1000, 77, 4095], 128, k_dim, 16)
    x[live] *= torch.logspace(-3, 3, int(live.sum()), device="cuda").unsqueeze(1).bfloat16()
    q, s = quant_rows(x, lay, ue8m0)
    qr, sr, _ = _quant_torch(x[live].float(), ue8m0)
    assert torch.equal(s[live], sr) and torch.equal(q[live].float(), qr.float())
    w = torch.randn(3, k_dim, 384, device="cuda").bfloat16()
    for contract_dim in (1, 2):
        b, bs = quant_weight(w, contract_dim, ue8m0)
        w_NK = w.transpose(1, 2) if contract_dim == 1 else w  # output channels first, contracted last
        qr, sr, _ = _quant_torch(w_NK.reshape(-1, w_NK.shape[2]).float(), ue8m0)
        assert b.stride(1) == 1 and tuple(b.shape) == (3, w_NK.shape[2], w_NK.shape[1])
        assert torch.equal(bs, sr.view(3, -1))
        assert torch.equal(b.transpose(1, 2).reshape(-1, w_NK.shape[2]).float(), qr.float())


@pytest.mark.parametrize("k_dim", [1024, 7168])
@pytest.mark.parametrize("swiglu", [False, True])
def test_triton_quant_1x128_matches_reference(k_dim, swiglu):
    """The row kernel with one scale per row per 128 columns (gemm=deep_gemm's activations): q and the
    scales bit for bit equal to the torch reference on live rows (K = 7168: seven blocks of 1,024
    columns per row; K = 1024: one)."""
    lay, x, _, live, _ = make([3000, 0, 1000, 77], 128, 2 * k_dim if swiglu else k_dim, 16)
    x[live] *= torch.logspace(-3, 3, int(live.sum()), device="cuda").unsqueeze(1).bfloat16()
    q, s = (swiglu_quant_rows if swiglu else quant_rows)(x, lay, group=128)
    a = x[live].float()
    if swiglu:
        a = a[:, :k_dim] * torch.sigmoid(a[:, :k_dim]) * a[:, k_dim:]
    qr, sr, _ = _quant_torch(a, False, 128)
    assert s.shape == (x.shape[0], k_dim // 128)
    if swiglu:  # the kernel's sigmoid and the reference's may differ in the last bit
        torch.testing.assert_close(s[live], sr, rtol=1e-6, atol=0)
    else:
        assert torch.equal(s[live], sr) and torch.equal(q[live].float(), qr.float())


def test_deep_gemm_backend_vs_its_cpu_stand_in():
    """gemm=deep_gemm (needs the deep_gemm package): DeepGEMM's kernel against the stand-in of
    tests/fake_deep_gemm.py on the same FP8 operands (1e-2: summation order and bf16 output), and
    the experts forward + backward against bf16 (the FP8 error)."""
    pytest.importorskip("deep_gemm")
    from dropless.ops.deep_gemm_backend import DeepGemmBackend
    from tests import fake_deep_gemm

    real, stand_in = DeepGemmBackend(), DeepGemmBackend(module=fake_deep_gemm, emulate=True)
    lay, x, w, live, _ = make([2000, 0, 513, 129, 4000], 128, 1024, 2048)
    xq, xs = real.quant_act(x, lay)
    b, bs = real.weight(w)
    y = real.scaled_gmm(xq, xs, b, bs, lay)
    y_ref = stand_in.scaled_gmm(xq.cpu(), xs.cpu(), b.cpu(), bs.cpu(), ExpertLayout.from_counts(
        lay.counts.cpu(), alignment=128, capacity=lay.capacity))
    print("deep_gemm vs stand-in", rel(y[live].cpu(), y_ref[live.cpu()]))
    assert rel(y[live].cpu(), y_ref[live.cpu()]) < 1e-2
    ex = GroupedExperts(1024, 512, 5, gemm=real).cuda().bfloat16()
    ref = GroupedExperts(1024, 512, 5, gemm="torch").cuda().bfloat16()
    ex.init_weights(1, 2)
    ref.load_state_dict(ex.state_dict())
    xs_ = [x.clone().requires_grad_(True) for _ in range(2)]
    y8, yb = ex(xs_[0], lay), ref(xs_[1], lay)
    dy = torch.randn_like(y8)
    y8.backward(dy)
    yb.backward(dy)
    errs = [rel(y8[live], yb[live]), rel(xs_[0].grad[live], xs_[1].grad[live]),
            rel(ex.w13.grad, ref.w13.grad), rel(ex.w2.grad, ref.w2.grad)]
    print("deep_gemm experts vs bf16 (y, dx, dw13, dw2)", errs)
    assert all(e < 0.12 for e in errs)


@pytest.mark.parametrize("a", [1, 128])
@pytest.mark.parametrize("fast_accum", [False, True])
def test_scaled_grouped_mm_vs_emulation_and_fp64(a, fast_accum):
    counts = [700, 0, 1500, 333]
    lay, x, w, live, g = make(counts, a, 1024, 512)
    real, emu = Fp8Backend(fast_accum=fast_accum), Fp8Backend(emulate=True)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ws = [w.clone().requires_grad_(True) for _ in range(2)]
    ys = [grouped_mm(xi, wi, lay, be) for xi, wi, be in zip(xs, ws, (real, emu))]
    dy = torch.randn(ys[0].shape, device="cuda", generator=g).bfloat16()
    dy[~live] = NAN
    for y in ys:
        y.backward(dy)
    ref = torch.zeros(ys[0].shape, dtype=torch.float64, device="cuda")
    ref_dx = torch.zeros(x.shape, dtype=torch.float64, device="cuda")
    ref_dw = torch.zeros(w.shape, dtype=torch.float64, device="cuda")
    for i, (s, t) in enumerate(segments(lay)):
        ref[s:t], ref_dx[s:t] = x[s:t].double() @ w[i].double(), dy[s:t].double() @ w[i].double().t()
        ref_dw[i] = x[s:t].double().t() @ dy[s:t].double()
    e = dict(fwd_vs_emu=rel(ys[0][live], ys[1][live]), dgrad_vs_emu=rel(xs[0].grad[live], xs[1].grad[live]),
             fwd_vs_fp64=rel(ys[0][live], ref[live]), dgrad_vs_fp64=rel(xs[0].grad[live], ref_dx[live]),
             wgrad_vs_fp64=rel(ws[0].grad, ref_dw))
    print("fp8 GEMM errors", dict(alignment=a, fast_accum=fast_accum, **{k: f"{v:.2e}" for k, v in e.items()}))
    assert e["fwd_vs_emu"] < 1e-2 and e["dgrad_vs_emu"] < 1e-2
    assert 0.005 < e["fwd_vs_fp64"] < 0.06 and 0.005 < e["dgrad_vs_fp64"] < 0.06
    assert e["wgrad_vs_fp64"] < 1e-2  # bf16 weight gradient
    assert torch.equal(ws[0].grad[1], torch.zeros_like(ws[0].grad[1]))


@pytest.mark.parametrize("fast_accum", [False, True])
def test_long_contraction_accuracy(fast_accum):
    """K = 7168 (DeepSeek-V3's FC1): the kernel against fp64 of the same FP8 operands."""
    lay, x, w, live, _ = make([2048, 1024], 1, 7168, 1024)
    be = Fp8Backend(fast_accum=fast_accum)
    xq, xs = quant_rows(x, lay)
    b, bs = be.weight(w)
    out = be.scaled_gmm(xq, xs, b, bs, lay)
    ref = torch.zeros(out.shape, dtype=torch.float64, device="cuda")
    bd = b.double() * bs.double().unsqueeze(1)
    for i, (s, t) in enumerate(segments(lay)):
        ref[s:t] = (xq[s:t].double() * xs[s:t, None].double()) @ bd[i]
    err = rel(out[live], ref[live])
    print(f"K=7168 fast_accum={fast_accum}: kernel vs fp64 of its FP8 operands {err:.2e}")
    assert err < (1e-2 if fast_accum else 4e-3)  # bf16 output rounding alone is ~2e-3


@pytest.mark.parametrize("wgrad", ["bf16", "fp8", "fp8_expert"])
def test_grouped_experts_fp8_vs_bf16_on_gpu(wgrad):
    """gemm=fp8 experts (the weight gradient in bf16 or FP8) against bf16: output and every gradient
    within 0.1, the empty expert's dW exactly 0, NaN padding rows never in a gradient."""
    torch.manual_seed(0)
    counts, h_dim, i_dim = [900, 0, 1300, 17], 1024, 512
    lay, x, _, live, g = make(counts, 128, h_dim, 16)
    ex8 = GroupedExperts(h_dim, i_dim, len(counts), gemm=Fp8Backend(wgrad=wgrad))
    exb = GroupedExperts(h_dim, i_dim, len(counts), gemm="torch")
    ex8.init_weights(0, 0, std=0.03)
    exb.load_state_dict(ex8.state_dict())
    ex8, exb = ex8.cuda().bfloat16(), exb.cuda().bfloat16()
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [ex8(xs[0], lay), exb(xs[1], lay)]
    dy = torch.randn(ys[0].shape, device="cuda", generator=g).bfloat16()
    dy[~live] = NAN
    for y in ys:
        y.backward(dy)
    e = dict(y=rel(ys[0][live], ys[1][live]), dx=rel(xs[0].grad[live], xs[1].grad[live]),
             dw13=rel(ex8.w13.grad, exb.w13.grad), dw2=rel(ex8.w2.grad, exb.w2.grad))
    print(f"fp8 experts (wgrad {wgrad}) vs bf16", {k: f"{v:.2e}" for k, v in e.items()})
    assert all(v < 0.1 for v in e.values()), e
    for p in (ex8.w13.grad, ex8.w2.grad):
        assert torch.isfinite(p).all() and torch.equal(p[1], torch.zeros_like(p[1]))


@pytest.mark.parametrize("extra", [dict(), dict(num_token_chunks=2, recompute_fc1=True), dict(recompute_gather=True),
                                   dict(fold_routing_weights=True, expert_alignment=128)])
def test_moe_layer_fp8_vs_bf16_on_gpu(extra):
    args = dict(hidden_size=1024, moe_intermediate_size=512, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                topk_group=2, n_shared_experts=1, **extra)
    m8, mb = MoE(ModelArgs(**args, gemm="fp8"), 1), MoE(ModelArgs(**args, gemm="torch"), 1)
    m8.experts.backend = Fp8Backend(plan_gemms=False)  # every GEMM in FP8 (the crossover would pick bf16 here)
    m8.init_weights(0)
    mb.load_state_dict(m8.state_dict())
    m8, mb = m8.cuda().bfloat16(), mb.cuda().bfloat16()
    x = torch.randn(2, 512, 1024, device="cuda").bfloat16()
    x8, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y8, yb = m8(x8), mb(xb)
    dy = torch.randn_like(y8)
    y8.backward(dy)
    yb.backward(dy)
    assert rel(y8, yb) < 0.1 and rel(x8.grad, xb.grad) < 0.12
    assert rel(m8.experts.w13.grad, mb.experts.w13.grad) < 0.12


def test_nonfinite_live_row_is_a_device_side_error():
    """A NaN in a live row stops the run (device-side assert, seen at the next sync), not a silent NaN."""
    code = ("import torch\nfrom dropless.layout import ExpertLayout\nfrom dropless.ops.fp8_quant import quant_rows\n"
            "lay = ExpertLayout.from_counts(torch.tensor([4, 4], device='cuda'), 1, num_rows=8)\n"
            "x = torch.randn(8, 128, device='cuda').bfloat16(); x[5, 3] = float('nan')\n"
            "q, s = quant_rows(x, lay); torch.cuda.synchronize(); print('NO ERROR')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "NO ERROR" not in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("wgrad", ["bf16", "fp8"])
def test_fp8_moe_forward_backward_has_no_host_sync(wgrad):
    """The MoE layer with gemm=fp8, forward and backward, under ``set_sync_debug_mode("error")`` (weights
    cached, the FP8 weight-gradient kernel tuned by the first call)."""
    args = dict(hidden_size=1024, moe_intermediate_size=512, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                topk_group=2, n_shared_experts=1, expert_alignment=128)
    m = MoE(ModelArgs(**args, gemm="fp8"), 1)
    m.experts.backend = Fp8Backend(wgrad=wgrad, plan_gemms=False)
    m.init_weights(0)
    m = m.cuda().bfloat16()
    x = torch.randn(1, 512, 1024, device="cuda").bfloat16().requires_grad_(True)
    m(x).sum().backward()  # first call: the weights' FP8 copies are made (not in the timed path)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("extra,ue8m0", [(dict(), False), (dict(fold_routing_weights=True, expert_alignment=128), True),
                                         (dict(num_token_chunks=2), False)])
def test_fused_quantisation_equals_separate_passes_on_gpu(extra, ue8m0):
    """The FP8 codes written by the landing gather and the combine's backward (dropless/ops/fp8_fused_rows.py)
    are the separate quantisation passes' bit for bit, so the layer's output and every gradient are too."""
    args = dict(hidden_size=1024, moe_intermediate_size=512, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                topk_group=2, n_shared_experts=1, **extra)
    res = []
    for fused in (True, False):
        m = MoE(ModelArgs(**args, gemm="fp8"), 1)
        # every GEMM in FP8: the plan would differ between the two (fused_quant moves FC1's and FC2's data
        # gradient's quantisation into the row kernels, which changes where FP8 pays)
        m.experts.backend = Fp8Backend(ue8m0=ue8m0, fused_quant=fused, plan_gemms=False)
        m.init_weights(0)
        m = m.cuda().bfloat16()
        x = torch.randn(2, 512, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16()
        x.requires_grad_(True)
        y = m(x)
        y.backward(torch.randn(y.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(2)).bfloat16())
        res.append([y.detach(), x.grad] + [p.grad for p in m.parameters() if p.grad is not None])
    assert len(res[0]) == len(res[1]) >= 6
    for i, (a, b) in enumerate(zip(*res)):
        assert torch.equal(a, b), f"value {i}: {rel(a, b):.2e}"
