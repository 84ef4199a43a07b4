"""The grouped weight-gradient kernel (``dropless.ops.triton_wgrad``) against plain torch (float64).

Runs on CUDA (bf16 inputs), or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``
set before triton is imported; fp32 inputs there); skipped where triton is not installed.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

triton = pytest.importorskip("triton")
from dropless.layout import ExpertLayout  # noqa: E402
from dropless.ops import triton_wgrad as tw  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and Triton's interpreter is off", allow_module_level=True)
DT = torch.bfloat16 if DEV == "cuda" else torch.float32


def tol(dw_dtype):
    if dw_dtype == torch.bfloat16:
        return 1e-2  # the result is rounded to bf16
    return 1e-4 if DT == torch.bfloat16 else 1e-5  # fp32 sums (of exact bf16 products on CUDA)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def reference(x, dy, lay):
    """float64 ``[e, K, N]``: per expert, the live rows ``x[s:t]^T @ dy[s:t]`` (plain torch, host loop)."""
    e = lay.num_experts
    out = torch.zeros(e, x.shape[1], dy.shape[1], dtype=torch.float64, device=x.device)
    for i, (s, t) in enumerate(zip(lay.start.tolist(), lay.end.tolist())):
        out[i] = x[s:t].double().t() @ dy[s:t].double()
    return out


def operands(counts, A, K, N, extra_rows=23, seed=0):
    """A layout with padding (alignment gaps and a tail), and x/dy whose padding rows are NaN."""
    torch.manual_seed(seed)
    lay = ExpertLayout.from_counts(torch.tensor(counts, device=DEV), A, num_rows=sum(counts) + extra_rows)
    M = lay.capacity
    live = lay.live_mask()
    x = torch.randn(M, K, device=DEV).to(DT)
    dy = torch.randn(M, N, device=DEV).to(DT)
    x[~live] = float("nan")
    dy[~live] = float("nan")
    return lay, x, dy


LAYOUTS = [
    ([37, 0, 1, 50], 1),        # an empty expert, a single-row expert, counts not multiples of a block
    ([0, 17, 0, 33, 0], 8),     # empty experts first, in the middle and last; gaps of up to 7 rows
    ([65, 1, 0, 40], 64),       # gaps of up to 63 rows
]


@pytest.mark.parametrize("counts,A", LAYOUTS)
@pytest.mark.parametrize("dw_dtype", [torch.float32, torch.bfloat16])
def test_overwrite_matches_reference(counts, A, dw_dtype):
    K, N = 40, 72  # neither a multiple of the block sizes
    lay, x, dy = operands(counts, A, K, N)
    ref = reference(x, dy, lay)
    dw = torch.full((len(counts), K, N), float("nan"), device=DEV, dtype=dw_dtype)  # old contents ignored
    out = tw.grouped_wgrad_(dw, x, dy, lay, accumulate=False)
    assert out is dw
    assert torch.isfinite(dw).all()  # no NaN from the padding rows, none left from dw's old contents
    assert rel(dw, ref) < tol(dw_dtype)
    for i, c in enumerate(counts):
        if c == 0:
            assert (dw[i] == 0).all()
        else:
            assert rel(dw[i], ref[i]) < tol(dw_dtype)


@pytest.mark.parametrize("counts,A", LAYOUTS)
@pytest.mark.parametrize("dw_dtype", [torch.float32, torch.bfloat16])
def test_accumulate_adds_to_old_value(counts, A, dw_dtype):
    K, N = 40, 72
    lay, x, dy = operands(counts, A, K, N, seed=1)
    ref = reference(x, dy, lay)
    dw = torch.randn(len(counts), K, N, device=DEV).to(dw_dtype)
    old = dw.clone()
    tw.grouped_wgrad_(dw, x, dy, lay, accumulate=True)
    assert torch.isfinite(dw).all()
    exp = old.double() + ref
    assert rel(dw, exp) < tol(dw_dtype)
    for i, c in enumerate(counts):
        if c == 0:
            assert torch.equal(dw[i], old[i])  # an empty expert is left exactly as it was
        else:
            assert rel(dw[i], exp[i]) < tol(dw_dtype)


def test_chunks_accumulate_to_the_whole():
    """Two token chunks, the second accumulated into the first, give the gradient of all rows."""
    K, N = 48, 56
    lay1, x1, dy1 = operands([20, 0, 31], 8, K, N, seed=2)
    lay2, x2, dy2 = operands([5, 12, 0], 8, K, N, seed=3)
    dw = torch.empty(3, K, N, device=DEV, dtype=torch.float32)
    tw.grouped_wgrad_(dw, x1, dy1, lay1, accumulate=False)
    tw.grouped_wgrad_(dw, x2, dy2, lay2, accumulate=True)
    assert rel(dw, reference(x1, dy1, lay1) + reference(x2, dy2, lay2)) < tol(torch.float32)


def test_largest_first_orders_experts_by_rows_ties_by_index():
    counts = torch.tensor([3, 7, 0, 7, 1], device=DEV, dtype=torch.int32)
    order = tw.largest_first(counts)
    assert order.dtype == torch.int32 and order.tolist() == [1, 3, 0, 4, 2]


def test_torch_backend_weight_gradient_takes_the_kernel_with_few_tiles_per_expert(monkeypatch):
    """``TorchBackend.gmm_wgrad`` through :func:`grouped_wgrad` (NaN padding, an empty expert, the largest
    expert in the middle): the float64 product, exact zeros for the empty expert, and the inputs' padding
    left as it was (the ``grouped_mm`` path zero-fills it in place)."""
    from dropless.ops import select
    from dropless.ops import torch_backend as tb

    if DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)
    lay, x, dy = operands([5, 90, 0, 33], 8, 24, 40, seed=5)
    assert tb.wgrad_by_triton(x, dy.shape[1])
    dw = tb.TorchBackend().gmm_wgrad(x, dy, lay)
    assert dw.dtype == x.dtype and tuple(dw.shape) == (4, 24, 40)
    assert rel(dw, reference(x, dy, lay)) < tol(x.dtype)
    assert (dw[2] == 0).all()
    pad = ~lay.live_mask()
    assert torch.isnan(x[pad]).all() and torch.isnan(dy[pad]).all()
    if DEV == "cuda":  # the rule: 8 x 8 tiles per expert take the kernel, DeepSeek-V3's FC1 (56 x 32) grouped_mm
        assert tb.wgrad_by_triton(torch.empty(1, 1024, device=DEV, dtype=DT), 1024)
        assert not tb.wgrad_by_triton(torch.empty(1, 7168, device=DEV, dtype=DT), 4096)


def test_larger_shape_and_strided_rows():
    """More rows than one block per expert, K/N spanning several tiles, x a column slice of a wider buffer."""
    K, N = 96, 80
    counts = [150, 0, 3, 97]
    lay, xw, dy = operands(counts, 16, 2 * K, N, seed=4)
    x = xw[:, K:]  # row stride 2K, unit column stride (like the up half of h13)
    dw = torch.empty(len(counts), K, N, device=DEV, dtype=torch.float32)
    tw.grouped_wgrad_(dw, x, dy, lay, accumulate=False)
    assert rel(dw, reference(x, dy, lay)) < tol(torch.float32)


def test_counts_over_the_capacity_read_nothing_past_the_buffer():
    """A layout whose end points pass M (the dispatchers' device assert reports such counts): the kernel
    reads rows up to M only. Rows past the buffer (NaN in the same storage here) never reach dw."""
    K, N, M = 24, 40, 48
    lay = ExpertLayout(counts=torch.tensor([30, 40], dtype=torch.int32, device=DEV),
                       start=torch.tensor([0, 30], dtype=torch.int32, device=DEV),
                       end=torch.tensor([30, 70], dtype=torch.int32, device=DEV), capacity=M, alignment=1)
    xb = torch.randn(80, K, device=DEV).to(DT)
    dyb = torch.randn(80, N, device=DEV).to(DT)
    xb[M:] = float("nan")
    dyb[M:] = float("nan")
    x, dy = xb[:M], dyb[:M]
    dw = torch.empty(2, K, N, device=DEV, dtype=torch.float32)
    tw.grouped_wgrad_(dw, x, dy, lay, accumulate=False)
    ref = torch.stack([x[:30].double().t() @ dy[:30].double(), x[30:M].double().t() @ dy[30:M].double()])
    assert torch.isfinite(dw).all() and rel(dw, ref) < tol(torch.float32)


def test_out_of_place_checks_the_layout_like_the_in_place_call():
    """grouped_wgrad (the torch backend's call) refuses operands whose rows are not the layout's capacity,
    as grouped_wgrad_ does, instead of reading past them."""
    lay, x, dy = operands([40, 40], 1, 8, 8, extra_rows=0)
    with pytest.raises(ValueError, match="capacity 80"):
        tw.grouped_wgrad(x[:50], dy[:50], lay)
    assert rel(tw.grouped_wgrad(x, dy, lay), reference(x, dy, lay)) < tol(x.dtype)


def test_all_empty_and_no_rows():
    K, N = 24, 40
    lay = ExpertLayout.from_counts(torch.tensor([0, 0], device=DEV), 1, capacity=0)
    x = torch.empty(0, K, device=DEV, dtype=DT)
    dy = torch.empty(0, N, device=DEV, dtype=DT)
    dw = torch.full((2, K, N), float("nan"), device=DEV)
    tw.grouped_wgrad_(dw, x, dy, lay, accumulate=False)
    assert (dw == 0).all()
    dw = torch.randn(2, K, N, device=DEV)
    old = dw.clone()
    tw.grouped_wgrad_(dw, x, dy, lay, accumulate=True)
    assert torch.equal(dw, old)


def test_clear_errors():
    K, N = 40, 72
    lay, x, dy = operands([10, 5], 1, K, N)
    dw = torch.zeros(2, K, N, device=DEV)
    with pytest.raises(ValueError, match="x has .* rows but dy has"):
        tw.grouped_wgrad_(dw, x, dy[:-1], lay, accumulate=False)
    with pytest.raises(ValueError, match=r"dw shaped \[e, x.shape\[1\], dy.shape\[1\]\]"):
        tw.grouped_wgrad_(torch.zeros(2, N, K, device=DEV), x, dy, lay, accumulate=False)
    with pytest.raises(ValueError, match="layout has 2 experts"):
        tw.grouped_wgrad_(torch.zeros(3, K, N, device=DEV), x, dy, lay, accumulate=False)
    with pytest.raises(ValueError, match="share one dtype"):
        tw.grouped_wgrad_(dw, x, dy.to(torch.float16), lay, accumulate=False)
    with pytest.raises(ValueError, match="contiguous"):
        tw.grouped_wgrad_(torch.zeros(2, N, K, device=DEV).transpose(1, 2), x, dy, lay, accumulate=False)
    with pytest.raises(ValueError, match="unit stride"):
        tw.grouped_wgrad_(dw, torch.zeros(K, x.shape[0], device=DEV, dtype=DT).t(), dy, lay, accumulate=False)
    with pytest.raises(ValueError, match=r"need x \[M, K\]"):
        tw.grouped_wgrad_(dw[0], x, dy, lay, accumulate=False)


@pytest.mark.skipif(DEV != "cuda", reason="host-sync check needs CUDA")
def test_no_host_sync_after_tuning():
    K, N = 256, 384
    lay, x, dy = operands([300, 0, 129, 1], 128, K, N)
    dw = torch.empty(4, K, N, device=DEV, dtype=torch.float32)
    tw.grouped_wgrad_(dw, x, dy, lay, accumulate=False)  # the first call times the configs (syncs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tw.grouped_wgrad_(dw, x, dy, lay, accumulate=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel(dw, 2 * reference(x, dy, lay)) < tol(torch.float32)


@pytest.mark.skipif(DEV != "cuda", reason="host-sync check needs CUDA")
def test_a_new_row_count_of_the_same_class_is_not_tuned_again():
    """A dispatcher without a static capacity lands another M each step: one tuning per power-of-two
    class of M, not per M (each tuning syncs the host and times every config)."""
    K, N = 128, 256
    lay, x, dy = operands([300, 0, 129, 1], 128, K, N, extra_rows=23)
    dw = torch.empty(4, K, N, device=DEV, dtype=torch.float32)
    tw.grouped_wgrad_(dw, x, dy, lay, accumulate=False)
    torch.cuda.synchronize()
    tuned = len(tw._best_config)
    lay2, x2, dy2 = operands([250, 3, 100, 40], 128, K, N, extra_rows=80, seed=1)  # another M, same class
    assert lay2.capacity != lay.capacity and lay2.capacity.bit_length() == lay.capacity.bit_length()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tw.grouped_wgrad_(dw, x2, dy2, lay2, accumulate=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(tw._best_config) == tuned
    assert rel(dw, reference(x2, dy2, lay2)) < tol(torch.float32)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("accumulate", [False, True])
def test_other_input_dtypes(in_dtype, accumulate):
    """fp32 inputs (IEEE dots, no TF32) and fp16 inputs, into an fp32 dw."""
    K, N = 40, 72
    counts = [30, 0, 1, 19]
    torch.manual_seed(5)
    lay = ExpertLayout.from_counts(torch.tensor(counts, device=DEV), 8, num_rows=sum(counts) + 9)
    live = lay.live_mask()
    x = torch.randn(lay.capacity, K, device=DEV).to(in_dtype)
    dy = torch.randn(lay.capacity, N, device=DEV).to(in_dtype)
    x[~live] = float("nan")
    dy[~live] = float("nan")
    dw = torch.randn(len(counts), K, N, device=DEV) if accumulate else torch.empty(len(counts), K, N, device=DEV)
    exp = reference(x, dy, lay) + (dw.double() if accumulate else 0)
    tw.grouped_wgrad_(dw, x, dy, lay, accumulate=accumulate)
    assert torch.isfinite(dw).all()
    assert rel(dw, exp) < (1e-5 if in_dtype == torch.float32 else 1e-4)


@pytest.mark.parametrize("A", [1, 128])
def test_empty_experts_through_two_accumulated_chunks(A):
    """Empty experts (pytorch/pytorch#172439): live rows [162, 0, 2577, 446, 0, 83], K = 64, N = 32, NaN padding,
    as two chunks (the first written, the second added): dW[1] and dW[4] exactly 0, the others
    the float64 sum of both chunks' per-expert references."""
    counts = [162, 0, 2577, 446, 0, 83]
    lay1, x1, dy1 = operands(counts, A, 64, 32, seed=10)
    lay2, x2, dy2 = operands(counts, A, 64, 32, seed=11)
    dw = torch.full((6, 64, 32), float("nan"), device=DEV, dtype=torch.float32)
    tw.grouped_wgrad_(dw, x1, dy1, lay1, accumulate=False)
    tw.grouped_wgrad_(dw, x2, dy2, lay2, accumulate=True)
    ref = reference(x1, dy1, lay1) + reference(x2, dy2, lay2)
    assert (dw[1] == 0).all() and (dw[4] == 0).all()
    for i in (0, 2, 3, 5):
        assert rel(dw[i], ref[i]) < tol(torch.float32), i


# ----------------------------------------------------------------------------- FP8 operands
FP8_ACC_TOL = 1e-3 if DEV == "cuda" else 1e-5


def _fp8_operands(counts, K, N, promote, seed=0):
    """A layout at A = 128 (gaps, an empty expert, a tail), NaN padding rows, and the FP8 operands of
    x and dy as the backend makes them (the quantisation's own kernels on CUDA, its torch reference on
    the CPU: the interpreter's e4m3 conversion does not round to nearest)."""
    from dropless.ops.fp8_quant import quant_expert_columns, quant_token_blocks

    lay, x, dy = operands(counts, 128, K, N, extra_rows=150, seed=seed)
    quant = quant_token_blocks if promote else quant_expert_columns
    return lay, x, dy, quant(x, lay), quant(dy, lay)


def _dequant(q, s, lay, promote):
    a = q.t().double()
    if promote:
        return (a.view(s.shape[0], 128, -1) * s.double().unsqueeze(1)).view(a.shape)
    mp = a.shape[0]
    rex = torch.cat([lay.row_expert(), torch.full((mp - lay.capacity,), -1, device=a.device)])
    return a * s.double()[rex.clamp_min(0)]


@pytest.mark.parametrize("promote", [True, False])
@pytest.mark.parametrize("dw_dtype", [torch.float32, torch.bfloat16])
def test_fp8_wgrad_is_the_dequantised_product(promote, dw_dtype):
    """fp8_grouped_wgrad_: each expert's dW equals the float64 product of its dequantised FP8 codes
    (block scales applied per 128-row block, or per-expert scales once), the fp32 accumulation's
    error only; NaN in dw's old contents and in padding rows never shows; an empty expert is exact 0;
    ``accumulate`` adds onto dw (and leaves an empty expert's dw as it was). Experts of 300 and 129
    rows span 3 and 2 blocks, the last one partial."""
    counts, K, N = [300, 0, 129, 5], 64, 96  # N not a multiple of the 128-wide tiles on CUDA
    lay, x, dy, (aq, a_s), (bq, b_s) = _fp8_operands(counts, K, N, promote)
    a, b = _dequant(aq, a_s, lay, promote), _dequant(bq, b_s, lay, promote)
    dw = torch.full((len(counts), K, N), float("nan"), device=DEV, dtype=dw_dtype)
    assert tw.fp8_grouped_wgrad_(dw, aq, a_s, bq, b_s, lay, accumulate=False, promote=promote) is dw
    exact = reference(x, dy, lay)
    for i, (s0, t) in enumerate(zip(lay.start.tolist(), lay.end.tolist())):
        if t == s0:
            assert (dw[i] == 0).all()
            continue
        # fp32 dw: the fp32 sums of the interpreter; on CUDA Hopper's FP8 MMA accumulates each block's
        # products in reduced precision (1.3e-4 at DeepSeek-V3's per-rank shape, benchmarks/results/moe_layer.jsonl)
        assert rel(dw[i], a[s0:t].t() @ b[s0:t]) < (1e-2 if dw_dtype == torch.bfloat16 else FP8_ACC_TOL)
        assert 0.005 < rel(dw[i], exact[i]) < 0.06  # FP8 really ran, within the e4m3 bound
    old = torch.randn(dw.shape, device=DEV).to(dw_dtype)
    acc = old.clone()
    tw.fp8_grouped_wgrad_(acc, aq, a_s, bq, b_s, lay, accumulate=True, promote=promote)
    assert torch.equal(acc[1], old[1])
    assert rel(acc.double() - old.double(), dw) < (2e-2 if dw_dtype == torch.bfloat16 else FP8_ACC_TOL)


def test_fp8_wgrad_clear_errors():
    """Shapes, dtypes and the alignment are checked on the host before launch, each error naming the fix."""
    counts, K, N = [130, 7], 32, 32
    lay, x, dy, (aq, a_s), (bq, b_s) = _fp8_operands(counts, K, N, promote=True)
    dw = torch.empty(2, K, N, device=DEV)
    with pytest.raises(ValueError, match="codes shaped"):
        tw.fp8_grouped_wgrad_(dw, aq[:, :-128], a_s, bq, b_s, lay, accumulate=False)
    with pytest.raises(ValueError, match="scales must be"):
        tw.fp8_grouped_wgrad_(dw, aq, a_s[:1], bq, b_s, lay, accumulate=False)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        tw.fp8_grouped_wgrad_(dw, aq.view(torch.uint8), a_s, bq, b_s, lay, accumulate=False)
    lay64 = ExpertLayout.from_counts(torch.tensor(counts, device=DEV), 64, capacity=lay.capacity)
    with pytest.raises(ValueError, match="multiple of 128"):
        tw.fp8_grouped_wgrad_(dw, aq, a_s, bq, b_s, lay64, accumulate=False)
    lay_i64 = dataclasses.replace(lay, start=lay.start.long(), end=lay.end.long())
    with pytest.raises(ValueError, match="int32"):
        tw.fp8_grouped_wgrad_(dw, aq, a_s, bq, b_s, lay_i64, accumulate=False)
    with pytest.raises(ValueError, match="one device"):
        tw.fp8_grouped_wgrad_(torch.empty(2, K, N, device="meta"), aq, a_s, bq, b_s, lay, accumulate=False)
