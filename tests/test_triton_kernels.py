"""The live-row Triton kernels against plain torch (float64 references).

Runs on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` in the
environment before triton is imported, as ``.ci/run`` does); skipped where triton is not
installed.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
from dropless.layout import ExpertLayout  # noqa: E402
from dropless.ops import rows as rw  # noqa: E402
from dropless.ops import select  # noqa: E402
from dropless.ops import swiglu as sw  # noqa: E402
from dropless.ops import zero_fill as zf  # noqa: E402
from tests.once_rounded import bf16_toward_zero, near_cancelling  # noqa: E402
from tests.ue8m0_sweep import (  # noqa: E402
    amax_sweep,
    case_quant_expert_columns,
    case_quant_rows,
    case_quant_token_blocks,
    case_quant_weight,
    case_swiglu_quant,
    case_swiglu_quant_rows,
    check_scales,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and Triton's interpreter is off", allow_module_level=True)
DT = torch.bfloat16 if DEV == "cuda" else torch.float32
TOL = 1e-2 if DT == torch.bfloat16 else 1e-5


@pytest.fixture(autouse=True)
def _triton_path(monkeypatch):
    """Under the interpreter: take the Triton path with CPU tensors."""
    if DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("counts,A", [([96, 0, 129, 1], 128), ([128, 130, 65], 64), ([5, 0, 0, 70], 1)])
def test_swiglu_live_rows_only(counts, A):
    torch.manual_seed(0)
    lay = ExpertLayout.from_counts(torch.tensor(counts, device=DEV), A, num_rows=sum(counts) + 40)
    M, I = lay.capacity, 160
    live = lay.live_mask()
    h13 = torch.randn(M, 2 * I, device=DEV, dtype=DT)
    h13[~live] = float("nan")
    out = sw.swiglu_fwd(h13, lay)
    ref = torch.nn.functional.silu(h13[:, :I].double()) * h13[:, I:].double()
    assert rel(out[live], ref[live]) < TOL
    dout = torch.randn(M, I, device=DEV, dtype=DT)
    dout[~live] = float("nan")
    dh = sw.swiglu_bwd(h13, dout, lay)
    x = h13.double().requires_grad_()
    (torch.nn.functional.silu(x[:, :I]) * x[:, I:]).backward(dout.double())
    assert rel(dh[live], x.grad[live]) < TOL
    assert torch.isfinite(dh[live]).all() and torch.isfinite(out[live]).all()
    # folded routing weights: the gradient of swiglu(h13) · w, w scaled in inside the kernel
    w = torch.rand(M, device=DEV)
    w[~live] = float("nan")
    dhw = sw.swiglu_bwd(h13, dout, lay, w)
    x.grad = None
    wr = w.to(DT).double().unsqueeze(1)  # the forward multiplies by w in the rows' dtype
    (torch.nn.functional.silu(x[:, :I]) * x[:, I:] * wr).backward(dout.double())
    assert rel(dhw[live], x.grad[live]) < TOL


@pytest.mark.parametrize("block_n", [None, 64])  # 64: I = 160 in three column blocks, the last one partial
@pytest.mark.parametrize("with_layout", [True, False])
def test_swiglu_folded_weight_and_its_gradient(block_n, with_layout):
    """``swiglu_fwd(row_w=)`` multiplies the weight in; ``swiglu_bwd(row_w_grad=True)`` also gives
    ``d row_w = Σ dout · swiglu`` (one partial per column block, summed): both against float64 autograd."""
    torch.manual_seed(3)
    lay = ExpertLayout.from_counts(torch.tensor([96, 0, 129, 1], device=DEV), 128, num_rows=266)
    M, I = lay.capacity, 160
    live = lay.live_mask() if with_layout else torch.ones(M, dtype=torch.bool, device=DEV)
    cfg = sw.LaunchConfig(block_n=block_n) if block_n else None
    h13 = torch.randn(M, 2 * I, device=DEV, dtype=DT)
    dout = torch.randn(M, I, device=DEV, dtype=DT)
    w = torch.rand(M, device=DEV) + 0.5
    if with_layout:
        h13[~live], dout[~live], w[~live] = float("nan"), float("nan"), float("nan")
    lay_arg = lay if with_layout else None
    out = sw.swiglu_fwd(h13, lay_arg, row_w=w, config=cfg)
    x = h13.double().requires_grad_()
    wr = w.to(DT).double().requires_grad_()  # the weight as the kernel reads it: rounded to the rows' dtype
    y = torch.nn.functional.silu(x[:, :I]) * x[:, I:] * wr.unsqueeze(1)
    assert rel(out[live], y[live]) < TOL
    y.backward(dout.double())
    dh13, dw = sw.swiglu_bwd(h13, dout, lay_arg, w, row_w_grad=True, config=cfg)
    assert dw.shape == (M,) and dw.dtype == torch.float32
    assert rel(dh13[live], x.grad[live]) < TOL
    assert rel(dw[live], wr.grad[live]) < TOL
    assert torch.isfinite(dw[live]).all()
    # the weight's gradient does not depend on the weight, nor on whether dh13 is scaled by it
    _, dw_unweighted = sw.swiglu_bwd(h13, dout, lay_arg, None, row_w_grad=True, config=cfg)
    assert torch.equal(dw_unweighted[live], dw[live])
    # the torch references agree with the kernels (every row; padding rows are NaN in, so compare live rows)
    ref_dh13, ref_dw = sw.swiglu_bwd_torch(h13, dout, w, row_w_grad=True)
    assert rel(dh13[live], ref_dh13[live]) < TOL and rel(dw[live], ref_dw[live]) < TOL
    assert rel(out[live], sw.swiglu_fwd_torch(h13, w)[live]) < TOL


@pytest.mark.parametrize("weighted", [True, False])
def test_gather_sum_and_combine_bwd(weighted):
    torch.manual_seed(1)
    N, k, M, H = 37, 3, 140, 200
    dest = torch.randperm(M, device=DEV)[: N * k].view(N, k)
    dest[5, 1] = -1  # a dropped choice
    rows = torch.randn(M, H, device=DEV, dtype=DT)
    used = torch.zeros(M, dtype=torch.bool, device=DEV)
    used[dest[dest >= 0]] = True
    rows[~used] = float("nan")
    w = torch.rand(N, k, device=DEV) if weighted else None
    out = rw.gather_sum(rows, dest, w)
    r = rows.double()
    ref = torch.zeros(N, H, dtype=torch.float64, device=DEV)
    for j in range(k):
        d = dest[:, j]
        contrib = r[d.clamp(min=0)] * (w[:, j : j + 1].double() if weighted else 1.0)
        ref += torch.where((d >= 0).unsqueeze(1), contrib, torch.zeros_like(contrib))
    assert rel(out, ref) < TOL
    g = torch.randn(N, H, device=DEV, dtype=DT)
    wt = w if weighted else torch.ones(N, k, device=DEV)
    gy, gw = rw.combine_bwd(g, rows, dest, wt, M, need_grad_w=weighted)
    for j in range(k):
        d = dest[:, j]
        ok = d >= 0
        assert rel(gy[d[ok]], g[ok].double() * wt[ok, j : j + 1].double()) < TOL
        if weighted:
            exp = (g[ok].double() * r[d[ok]]).sum(-1)
            assert rel(gw[ok, j], exp) < TOL
            assert (gw[~ok, j] == 0).all()


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("addend_at", ["all", "slice"])
def test_gather_sum_adds_the_addend_before_its_one_rounding(weighted, addend_at):
    """The kernel's addend (the shared experts' output) joins the fp32 sum: bf16 routed and addend
    nearly cancelling give the float64 sum rounded once, bit for bit (on a GPU also equal to the
    torch path). Triton's interpreter casts fp32 to bf16 toward zero, a GPU to nearest even."""
    n, k, h = 23, 4, 200  # h not a power of two: a masked column block
    row0, rows_a = (0, None) if addend_at == "all" else (5, 11)
    y, dest, w, addend, want = near_cancelling(n, k, 140, h, seed=7, weighted=weighted, addend_rows=rows_a,
                                               addend_row0=row0, device=DEV, toward_zero=DEV == "cpu")
    out = rw.gather_sum(y, dest, w, addend, row0)
    assert torch.equal(out, want)
    if DEV == "cuda":
        assert torch.equal(out, rw.gather_sum_torch(y, dest, w, addend, row0))
    # an fp32 addend is read as it is (no bf16 copy first)
    assert torch.equal(rw.gather_sum(y, dest, w, addend.float(), row0), want)
    # two roundings (the routed sum cast first, in the same cast mode) miss on these inputs
    routed = rw.gather_sum(y, dest, w).double()
    routed[row0:row0 + addend.shape[0]] += addend.double()
    assert not torch.equal(bf16_toward_zero(routed) if DEV == "cpu" else routed.to(torch.bfloat16), want)


def test_zero_empty_experts_touches_only_empty_ones():
    dw = torch.randn(5, 60, 70, device=DEV, dtype=DT)
    before = dw.clone()
    counts = torch.tensor([1, 0, 3, 0, 2], dtype=torch.int32, device=DEV)
    zf.zero_empty_experts_(dw, counts)
    for i, c in enumerate(counts.tolist()):
        if c == 0:
            assert (dw[i] == 0).all()
        else:
            assert torch.equal(dw[i], before[i])


def test_zero_gap_rows_writes_only_the_gaps():
    lay = ExpertLayout.from_counts(torch.tensor([96, 0, 129, 1], device=DEV), 128, capacity=600)
    buf = torch.randn(600, 40, device=DEV, dtype=DT)
    before = buf.clone()
    zf.zero_gap_rows_(buf, lay)
    gaps = [range(96, 128), range(257, 384)]  # after expert 0, and after expert 2 (expert 1 is empty)
    gap = torch.zeros(600, dtype=torch.bool)
    for g in gaps:
        gap[list(g)] = True
    gap = gap.to(DEV)
    assert (buf[gap] == 0).all()
    assert torch.equal(buf[~gap], before[~gap])  # live rows and the tail after end[e-1] untouched


@pytest.mark.parametrize("A", [1, 8])
@pytest.mark.parametrize("opts", [{}, dict(recompute_fc1=True, fold_routing_weights=True),
                                  dict(recompute_swiglu=True),
                                  dict(num_token_chunks=3),  # chunks' weight gradients: dropless.ops.triton_wgrad
                                  dict(num_token_chunks=3, recompute_fc1=True, fold_routing_weights=True,
                                       recompute_gather=True)])
def test_layer_on_the_kernel_path_matches_float64_reference(monkeypatch, A, opts):
    """The whole MoE layer taking every Triton path (SwiGLU, gather-sum, combine backward, zeroed
    gaps and empty experts, the chunks' accumulated weight gradients) against the float64
    reference loop: output and all gradients."""
    from dropless import ModelArgs
    from dropless.moe import MoE
    from tests.moe_reference import reference_moe

    torch.manual_seed(0)
    args = ModelArgs(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                     n_group=4, topk_group=2, aux_loss_alpha=0.0, expert_alignment=A, routed_scaling_factor=2.5,
                     **opts)
    m = MoE(args, 0)
    m.init_weights(1)
    m = m.to(DEV).to(DT)
    m.router.e_score_correction_bias[3] = -100.0  # expert 3 gets no row
    x = torch.randn(2, 12, 32, device=DEV, dtype=DT, requires_grad=True)
    y = m(x)
    g = torch.randn_like(y)
    y.backward(g)
    idx = m.router(x.detach().reshape(-1, 32)).topk_idx_Tk.cpu()
    ps = [m.router.weight, m.experts.w13, m.experts.w2, m.shared_experts.w1.weight, m.shared_experts.w3.weight,
          m.shared_experts.w2.weight]
    pr = [p.detach().double().cpu().requires_grad_() for p in ps]
    xr = x.detach().reshape(-1, 32).double().cpu().requires_grad_()
    yr = reference_moe(xr, pr[0], idx, pr[1], pr[2], pr[3:], scaling=2.5)
    yr.backward(g.reshape(-1, 32).double().cpu())
    tol = 2e-2 if DT == torch.bfloat16 else 1e-5
    assert rel(y.reshape(-1, 32).cpu(), yr) < tol
    assert rel(x.grad.reshape(-1, 32).cpu(), xr.grad) < tol
    for p, q in zip(ps, pr):
        assert rel(p.grad.cpu(), q.grad) < tol
    assert (m.experts.w13.grad[3] == 0).all() and (m.experts.w2.grad[3] == 0).all()


# ------------------------------------------------------------------ the live-row grid (issue 13)
SENTINEL = -12345.0  # exactly representable in bf16 and fp32: a padding row that still holds it was not written


@pytest.mark.parametrize("counts,A,M", [([96, 0, 129, 1], 128, 600), ([0, 0, 0], 8, 64), ([300, 0, 0], 1, 320),
                                        ([33] * 9, 16, 9 * 48)])
@pytest.mark.parametrize("config", [None, sw.LaunchConfig(programs_per_sm=1, block_m=2),
                                    sw.LaunchConfig(schedule="expert"),
                                    sw.LaunchConfig(schedule="expert", programs_per_sm=1, block_n=64),
                                    sw.LaunchConfig(programs_per_sm=1, block_m=2, block_n=64),
                                    sw.LaunchConfig(block_m=1, block_n=2048, num_warps=8, programs_per_sm=16)])
def test_swiglu_grid_stride_covers_live_rows_and_never_writes_padding(counts, A, M, config):
    """Every live row is computed whatever the grid is (a grid-stride loop; both schedules), and no padding
    row of any output is written."""
    torch.manual_seed(2)
    lay = ExpertLayout.from_counts(torch.tensor(counts, device=DEV), A, capacity=M)
    I = 136  # not a multiple of the column block: the masked column tail
    live = lay.live_mask()
    h13 = torch.randn(M, 2 * I, device=DEV, dtype=DT)
    h13[~live] = float("nan")
    dout = torch.randn(M, I, device=DEV, dtype=DT)
    dout[~live] = float("nan")
    out = torch.full((M, I), SENTINEL, device=DEV, dtype=DT)
    dh = torch.full((M, 2 * I), SENTINEL, device=DEV, dtype=DT)
    sw.swiglu_fwd(h13, lay, out=out, config=config)
    sw.swiglu_bwd(h13, dout, lay, out=dh, config=config)
    assert (out[~live] == SENTINEL).all() and (dh[~live] == SENTINEL).all()
    if live.any():
        ref = sw.swiglu_fwd_torch(h13.double())
        assert rel(out[live], ref[live]) < TOL
        assert rel(dh[live], sw.swiglu_bwd_torch(h13.double(), dout.double())[live]) < TOL


def test_swiglu_dense_path_equals_the_layout_path_on_live_rows():
    torch.manual_seed(3)
    lay = ExpertLayout.from_counts(torch.tensor([40, 0, 70], device=DEV), 8, capacity=130)
    live = lay.live_mask()
    h13 = torch.randn(130, 2 * 64, device=DEV, dtype=DT)
    dout = torch.randn(130, 64, device=DEV, dtype=DT)
    w = torch.rand(130, device=DEV)
    dense, with_layout = sw.swiglu_fwd(h13), sw.swiglu_fwd(h13, lay)
    assert torch.equal(dense[live], with_layout[live])
    assert rel(dense, sw.swiglu_fwd_torch(h13.double())) < TOL  # every row, without a layout
    assert torch.equal(sw.swiglu_bwd(h13, dout, None, w)[live], sw.swiglu_bwd(h13, dout, lay, w)[live])


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """Spacing of float8_e4m3fn numbers at |v| (3 mantissa bits; subnormal spacing 2^-9)."""
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -6)))
    return torch.exp2(e - 3)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_swiglu_quant_kernel(ue8m0):
    """Fused SiLU·mul + e4m3 quant: the 1×128 scales of the reference, padding rows of q and scale never
    written, and (where the e4m3 conversion is the hardware's) q·scale within one e4m3 step of the
    bf16 SwiGLU."""
    torch.manual_seed(4)
    I, M = 256, 400
    lay = ExpertLayout.from_counts(torch.tensor([130, 0, 3, 120], device=DEV), 16, capacity=M)
    live = lay.live_mask()
    h13 = torch.randn(M, 2 * I, device=DEV, dtype=DT) * 3
    h13[~live] = float("nan")
    q = torch.full((M, I), 0x7E, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)  # a byte sentinel
    scale = torch.full((I // 128, M), SENTINEL, device=DEV).t()
    sw.swiglu_quant(h13, lay, ue8m0, out=(q, scale))
    q2, s2 = sw.swiglu_quant(h13, lay, ue8m0, config=sw.LaunchConfig(schedule="expert", block_n=128, block_m=8))
    assert torch.equal(q2.view(torch.uint8)[live], q.view(torch.uint8)[live]) and torch.equal(s2[live], scale[live])
    q3, s3 = sw.swiglu_quant(h13, lay, ue8m0, config=sw.LaunchConfig(block_n=128, block_m=2, programs_per_sm=1))
    assert torch.equal(q3.view(torch.uint8)[live], q.view(torch.uint8)[live]) and torch.equal(s3[live], scale[live])
    assert (q.view(torch.uint8)[~live] == 0x7E).all() and (scale[~live] == SENTINEL).all()
    a = sw.swiglu_fwd_torch(h13.float())  # fp32 SwiGLU
    _, sref = sw.quant_fp8_torch(a, ue8m0)
    assert rel(scale[live], sref[live]) < 1e-5
    if ue8m0:
        assert torch.equal(torch.exp2(torch.log2(scale[live]).round()), scale[live])
    if DEV == "cpu":
        pytest.skip("Triton 3.6's interpreter converts fp32 to e4m3 without rounding to nearest (126.1 -> 64), "
                    "so q's values are checked on CUDA only")
    deq = (q.float().view(M, I // 128, 128) * scale.unsqueeze(-1)).view(M, I)
    ref = sw.swiglu_fwd_torch(h13)[live].float()  # the bf16 result
    step = e4m3_step(ref / scale[live].repeat_interleave(128, 1)) * scale[live].repeat_interleave(128, 1)
    assert ((deq[live] - ref).abs() <= step).all()


@pytest.mark.parametrize("A", [1, 128])
def test_scatter_rows_writes_live_rows_once_each(A):
    from dropless.permute import sort_by_expert

    torch.manual_seed(5)
    N, k, E, H = 50, 4, 6, 72
    idx = torch.randint(0, E, (N, k), device=DEV)
    idx[3, 2] = -1  # routed elsewhere
    lay, dest, src = sort_by_expert(idx, E, A)
    x = torch.randn(N, H, device=DEV, dtype=DT)
    rows = rw.scatter_rows(x, dest, lay.capacity)
    live = lay.live_mask()
    assert torch.equal(rows[live], x[src[live]])
    assert torch.equal(rw.land_rows(x, src, dest)[live], x[src[live]])


def test_moe_layer_compiles_on_the_triton_kernel_path(monkeypatch):
    """torch.compile(fullgraph=True) of the MoE layer with the Triton kernels as custom ops (issue 12 item 4):
    forward and backward bitwise equal to eager. The shared expert runs its plain form in eager too: its
    eager gate-up form (one fused SwiGLU kernel, rounded once; ``dropless/mlp.py``) differs from the
    compiled plain ops in the last bf16 bit by design, and made y, x's gradient and the shared expert's
    gradients differ on an H200 (the routed path and the router were bitwise equal)."""
    from dropless import mlp
    from tests.test_compile import _check_equal, _layer

    monkeypatch.setattr(mlp, "gate_up_kernels", lambda x, hidden_dim: False)
    torch.manual_seed(1)
    m = _layer(fold_routing_weights=True).to(DEV).to(DT)
    x = torch.randn(2, 12, 32, device=DEV, dtype=DT, requires_grad=True)
    g = torch.randn(2, 12, 32, device=DEV, dtype=DT)
    eager, compiled = _check_equal(m, x, g)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_kernels_stay_inside_the_buffer_when_counts_overflow_the_capacity():
    """A layout whose end points pass M (counts over capacity; the dispatchers' device assert reports it):
    the kernels clamp every row range to M and touch nothing beyond the buffer."""
    ends = torch.tensor([30, 70], dtype=torch.int32, device=DEV)
    lay = ExpertLayout(counts=torch.tensor([30, 40], dtype=torch.int32, device=DEV),
                       start=torch.tensor([0, 30], dtype=torch.int32, device=DEV), end=ends, capacity=48, alignment=1)
    I = 64
    big = torch.randn(64, 2 * I, device=DEV, dtype=DT)
    h13 = big[:48]  # rows 48..63 of the same storage lie beyond the buffer
    out = torch.full((64, I), SENTINEL, device=DEV, dtype=DT)
    sw.swiglu_fwd(h13, lay, out=out[:48])
    assert (out[48:] == SENTINEL).all()
    assert rel(out[:48], sw.swiglu_fwd_torch(h13.double())) < TOL


@pytest.mark.parametrize("group,block_cols,K", [(0, None, 384), (0, None, 1536), (128, None, 384), (128, 128, 384)])
@pytest.mark.parametrize("swiglu", [False, True])
def test_fp8_quant_rows_kernel_group_scales_live_rows_only(group, block_cols, K, swiglu, monkeypatch):
    """fp8_quant's row kernel, one scale per row (group 0) or per row per 128 columns: scales equal the
    torch reference on live rows (K = 384 and 1,536: not powers of two, so the kernel's last
    columns are masked; 1,536 takes the one-row-block launch of K > 1,024; with ``block_cols=128``
    the 1x128 path cuts each row into three column blocks, each a unit of its own), a NaN in a
    padding row ignored and one in a live row flagged (q's values are checked on CUDA: the
    interpreter's e4m3 conversion does not round to nearest)."""
    from dropless.ops import fp8_quant as fq

    if block_cols:
        monkeypatch.setattr(fq, "GROUP_BLOCK", (fq.GROUP_BLOCK[0], block_cols) + fq.GROUP_BLOCK[2:])
    torch.manual_seed(3)
    counts, A = [70, 0, 5, 129], 16
    lay = ExpertLayout.from_counts(torch.tensor(counts, device=DEV), alignment=A,
                                   capacity=sum(-(-c // A) * A for c in counts) + 7)
    M, live = lay.capacity, lay.live_mask()
    x = torch.randn(M, 2 * K if swiglu else K, device=DEV, dtype=DT) * 3
    x[~live] = float("nan")
    op = fq.swiglu_quant_rows if swiglu else fq.quant_rows
    q, s = op(x, lay, group=group)
    assert s.shape == ((M, K // 128) if group else (M,)) and q.shape == (M, K)
    a = x.float()
    if swiglu:
        a = a[:, :K] * torch.sigmoid(a[:, :K]) * a[:, K:]
    _, sref, _ = fq._quant_torch(torch.where(live.unsqueeze(1), a, 0.0), False, group)
    assert rel(s[live], sref[live]) < 1e-6
    x2 = x.clone()
    x2[torch.nonzero(live)[3, 0], 5] = float("nan")
    if DEV == "cpu":  # the flag raises through torch._assert_async at once on CPU
        with pytest.raises(RuntimeError, match="NaN or Inf"):
            op(x2, lay, group=group)
    with pytest.raises(ValueError, match="multiple of the 1x128"):
        op(x[:, :100] if not swiglu else x[:, :200], lay, group=128)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_quant_weight_column_kernel_equals_the_row_path(ue8m0):
    """quant_weight's forward operand (contract_dim=1) from the column kernel, which reads ``w [e, K, N]``
    and writes ``[e, N, K]`` e4m3 rows without a transposing copy first: scales and codes bit for bit
    the row kernel's on the transposed copy (the path it replaces), scales the torch reference's; K = 200 and
    N = 100 are not multiples of the 128 x 64 tiles; a NaN weight gives a NaN scale, which raises."""
    from dropless.ops import fp8_quant as fq

    torch.manual_seed(5)
    w = torch.randn(3, 200, 100, device=DEV, dtype=DT) * torch.logspace(-2, 2, 100, device=DEV).to(DT)
    b, s = fq.quant_weight(w, contract_dim=1, ue8m0=ue8m0)
    assert tuple(b.shape) == (3, 200, 100) and b.stride(1) == 1 and tuple(s.shape) == (3, 100)
    w_NK = w.transpose(1, 2).contiguous()
    q_rows, s_rows = fq.quant_rows(w_NK.view(-1, 200), None, ue8m0, check_finite=False)
    assert torch.equal(s, s_rows.view(3, 100))
    _, s_ref, _ = fq._quant_torch(w_NK.view(-1, 200).float(), ue8m0)
    assert rel(s, s_ref.view(3, 100)) < 1e-6
    # the codes too (the interpreter's e4m3 conversion is the same in both kernels)
    assert torch.equal(b.transpose(1, 2).reshape(-1, 200).view(torch.uint8), q_rows.view(torch.uint8))
    w2 = w.clone()
    w2[1, 17, 42] = float("nan")
    q2 = torch.empty(3, 100, 200, dtype=fq.FP8_DTYPE, device=DEV)
    s2 = torch.empty(3, 100, device=DEV)
    w2_NK = w2.transpose(1, 2)  # the kernel alone (quant_weight's device-side assert would end a CUDA process)
    fq._quant_cols_kernel[(3, 2)](w2_NK, q2, s2, 100, w2_NK.stride(0), w2_NK.stride(2), w2_NK.stride(1), K=200,
                                  UE8M0=ue8m0, BLOCK_K=128, BLOCK_N=64)
    assert torch.isnan(s2[1, 42]) and torch.isfinite(s2[1, :42]).all() and torch.isfinite(s2[1, 43:]).all()
    if DEV == "cpu":  # the flag raises through torch._assert_async at once on CPU
        with pytest.raises(RuntimeError, match="NaN or Inf"):
            fq.quant_weight(w2, contract_dim=1)


@pytest.mark.parametrize("per_sm", [16, 1], ids=["default-grid", "4-programs"])
@pytest.mark.parametrize("expert_scales", [False, True])
def test_fp8_quant_token_blocks_kernel_live_rows_only(expert_scales, per_sm, monkeypatch):
    """The FP8 weight gradient's operand kernels (``quant_token_blocks``: one scale per column per
    128-row block; ``quant_expert_columns``: per column per expert, two passes): scales equal the torch
    reference (bit for bit: the same fp32 expressions) over live blocks / experts, codes transposed
    ``[K, M']`` with zeros past each expert's end up to its block boundary; block codes equal the row
    kernel's on the block's transposed rows (on the CPU the interpreter's e4m3 conversion is the same in
    both kernels), and the torch reference's on CUDA; NaN padding rows never reach a scale; a NaN in a
    live row raises (on the CPU at once). K = 200 is not a multiple of the column tiles. The flat grid's
    programs take several tiles each with 4 programs (the CPU counts 4 SMs); a block holding no live row
    (the alignment gap, the tail) is never written."""
    from dropless.ops import fp8_quant as fq

    monkeypatch.setattr(fq, "TOKEN_PER_SM", per_sm)
    torch.manual_seed(4)
    counts, K = [300, 0, 129, 5], 200
    lay = ExpertLayout.from_counts(torch.tensor(counts, device=DEV), alignment=128, num_rows=sum(counts) + 150)
    M, live = lay.capacity, lay.live_mask()
    x = torch.randn(M, K, device=DEV, dtype=DT) * torch.logspace(-1, 1, K, device=DEV).to(DT)
    x[~live] = float("nan")
    quant = fq.quant_expert_columns if expert_scales else fq.quant_token_blocks
    q, s = quant(x, lay)
    mp = -(-M // 128) * 128
    assert q.shape == (K, mp) and q.dtype == fq.FP8_DTYPE
    use_triton = select.use_triton
    monkeypatch.setattr(select, "use_triton", lambda t: False)  # the torch reference
    q_ref, s_ref = quant(x, lay)
    monkeypatch.setattr(select, "use_triton", use_triton)
    segs = [(a, b) for a, b in zip(lay.start.tolist(), lay.end.tolist()) if b > a]
    if expert_scales:
        live_e = [i for i, c in enumerate(counts) if c]
        assert torch.equal(s[live_e], s_ref[live_e])
    for s0, t in segs:
        b0, b1 = s0 // 128, -(-t // 128)
        if not expert_scales:
            assert torch.equal(s[b0:b1], s_ref[b0:b1])
        assert (q[:, t:b1 * 128].float() == 0).all()
        if DEV == "cuda":
            assert torch.equal(q[:, s0:b1 * 128].view(torch.uint8), q_ref[:, s0:b1 * 128].view(torch.uint8))
        elif not expert_scales:
            xz = torch.where(live.unsqueeze(1), x, 0.0)
            xz = torch.cat([xz, xz.new_zeros(mp - M, K)])
            for b in range(b0, b1):
                qr, sr = fq.quant_rows(xz[b * 128:(b + 1) * 128].t().contiguous(), None)
                assert torch.equal(q[:, b * 128:(b + 1) * 128].view(torch.uint8), qr.view(torch.uint8))
                assert torch.equal(s[b], sr)
    if DEV == "cpu":
        x2 = x.clone()
        x2[torch.nonzero(live)[200, 0], 3] = float("nan")
        with pytest.raises(RuntimeError, match="NaN or Inf"):
            quant(x2, lay)
    if not expert_scales:  # the padding blocks keep what was there
        q2 = torch.full((K, mp), 0x5A, dtype=torch.uint8, device=DEV).view(fq.FP8_DTYPE)
        s2 = torch.full((mp // 128, K), -1.0, device=DEV)
        fq._tok_launch(x, q2, s2, torch.zeros(1, dtype=torch.int32, device=DEV), lay, 0, False)
        blk_live = torch.zeros(mp // 128, dtype=torch.bool)
        for s0, t in segs:
            blk_live[s0 // 128:-(-t // 128)] = True
        dead = (~blk_live).nonzero().squeeze(1).tolist()
        assert dead and all((s2[b] == -1.0).all() for b in dead)
        assert all((q2.view(torch.uint8)[:, b * 128:(b + 1) * 128] == 0x5A).all() for b in dead)
        assert torch.equal(s2[blk_live.to(DEV)], s[blk_live.to(DEV)])


UE8M0_KERNEL_CASES = {
    "quant_rows": lambda a: case_quant_rows(a, DEV),
    "quant_rows_1x128": lambda a: case_quant_rows(a, DEV, group=128),
    "swiglu_quant_rows": lambda a: case_swiglu_quant_rows(a, DEV),
    "swiglu_quant_rows_1x128": lambda a: case_swiglu_quant_rows(a, DEV, group=128),
    "swiglu_quant": lambda a: case_swiglu_quant(a, DEV),
    "quant_token_blocks": lambda a: case_quant_token_blocks(a, DEV),
    "quant_expert_columns": lambda a: case_quant_expert_columns(a, DEV),
    "quant_weight_columns": lambda a: case_quant_weight(a, DEV, 1),
    "quant_weight_rows": lambda a: case_quant_weight(a, DEV, 2),
}


@pytest.mark.parametrize("name", list(UE8M0_KERNEL_CASES))
def test_ue8m0_kernel_scale_is_the_exact_power_of_two_ceiling(name):
    """Every quantising kernel (:func:`dropless.ops.ue8m0.pow2_ceil_bits`): at, one fp32 step below and
    one above 448·2^k, the scale is the smallest power of two with amax / scale <= 448, DeepGEMM's
    bit for bit."""
    scale, amax = UE8M0_KERNEL_CASES[name](amax_sweep(-40, 100))
    check_scales(amax, scale, name)
