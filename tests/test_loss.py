"""dropless.model.loss: the chunked linear cross-entropy against a float64 reference on full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dropless.config import ConfigError
from dropless.model.loss import chunk_rows, linear_cross_entropy, resolve_loss_impl

T, H, V = 23, 16, 37          # V is not a multiple of anything the chunking uses
CHUNK = 5 * V + 3             # -> 5 rows per chunk: chunks of 5, 5, 5, 5, 3 rows


def _inputs(dtype, ignore=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, H, generator=g) * 2).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    y = torch.randint(0, V, (T,), generator=g)
    if ignore:
        y[[0, 7, 8, 22]] = -100
    return h, w, y


def _reference(h, w, y, reduction="mean"):
    """float64 F.cross_entropy on the full logits; (loss, dh, dw)."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    loss = F.cross_entropy(h64 @ w64.t(), y, ignore_index=-100, reduction=reduction)
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [False, True])
def test_loss_and_gradients_equal_float64_reference(dtype, tol, reduction, ignore):
    h, w, y = _inputs(dtype, ignore)
    loss = linear_cross_entropy(h, w, y, reduction=reduction, max_chunk_elements=CHUNK)
    loss.backward()
    want, dh, dw = _reference(h, w, y, reduction)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    # references computed from the (rounded) inputs themselves; bf16 adds the logits' rounding
    torch.testing.assert_close(loss.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(h.grad.double(), dh, rtol=tol, atol=tol * dh.abs().max().item())
    torch.testing.assert_close(w.grad.double(), dw, rtol=tol, atol=tol * dw.abs().max().item())
    if ignore:
        assert torch.equal(h.grad[[0, 7, 8, 22]], torch.zeros(4, H, dtype=dtype))


def test_loss_scale_scales_the_gradients_and_grad_accumulates():
    h, w, y = _inputs(torch.float32)
    (3.0 * linear_cross_entropy(h, w, y, max_chunk_elements=CHUNK)).backward()
    _, dh, dw = _reference(h, w, y)
    tol = dict(rtol=2e-5, atol=2e-5 * dw.abs().max().item())
    torch.testing.assert_close(h.grad.double(), 3 * dh, **tol)
    torch.testing.assert_close(w.grad.double(), 3 * dw, **tol)
    linear_cross_entropy(h, w, y, max_chunk_elements=CHUNK).backward()    # accumulates into .grad
    torch.testing.assert_close(w.grad.double(), 4 * dw, **tol)


def test_chunk_size_does_not_change_the_result():
    h, w, y = _inputs(torch.float64)
    base = None
    for elements in (1, V, 4 * V - 1, 10**9):  # 1 row per chunk ... everything in one chunk
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, y, max_chunk_elements=elements)
        loss.backward()
        got = (loss, h.grad.clone(), w.grad.clone())
        if base is None:
            base = got
        for a, b in zip(got, base):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    assert chunk_rows(V, 1) == 1 and chunk_rows(V, 4 * V - 1) == 3 and chunk_rows(129280, 1 << 25) == 259


def _previous_arithmetic(h, w, y, rows, scale):
    """The chunked loss as written before the copies were removed (a zero-filled fp32 dW that
    each chunk adds to, dh rows assigned from a temporary, backward's fp32 ``dW · g`` then a
    cast): (loss, dh, dw) for the loss multiplied by ``scale``, on CPU."""
    from dropless.ops.softmax_ce import softmax_ce_grad_
    cd = torch.promote_types(h.dtype, w.dtype)
    acc = torch.promote_types(cd, torch.float32)
    valid = y != -100
    tgt = torch.where(valid, y, torch.zeros_like(y))
    n = valid.sum().clamp_min(1).to(acc)
    loss = torch.zeros((), dtype=acc)
    dh = torch.empty_like(h)
    dw = torch.zeros(w.shape, dtype=acc)
    with torch.no_grad():
        for lo in range(0, h.shape[0], rows):
            hc = h[lo:lo + rows].to(cd)
            z = hc @ w.to(cd).t()
            wc = valid[lo:lo + rows].to(acc) * (1.0 / n)
            lc = softmax_ce_grad_(z, tgt[lo:lo + rows], wc, grad=True)
            loss = loss + (lc.to(acc) * wc).sum()
            dh[lo:lo + rows] = z @ w.to(cd)
            if z.dtype == acc:
                dw.addmm_(z.t(), hc)
            else:
                dw.add_(z.t() @ hc)
    g = torch.tensor(scale, dtype=acc)
    return loss * g, dh * g.to(dh.dtype), (dw * g.to(dw.dtype)).to(w.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
def test_results_bitwise_equal_the_previous_arithmetic(dtype, scale):
    """The first chunk's product is dW (no zero-filled buffer), dh's rows are GEMM outputs written
    in place, backward scales and casts dW in one op: the same bits as before, loss scale included."""
    h, w, y = _inputs(dtype, seed=5)
    loss = linear_cross_entropy(h, w, y, max_chunk_elements=CHUNK)
    (loss * scale).backward()
    want_loss, want_dh, want_dw = _previous_arithmetic(h.detach(), w.detach(), y, 5, scale)
    assert torch.equal((loss * scale).detach(), want_loss)
    assert torch.equal(h.grad, want_dh) and torch.equal(w.grad, want_dw)


def test_no_zero_filled_dw_and_no_fp32_copy_in_backward():
    """Per step the head's dW is not zero-filled first and backward makes no fp32 [V, H] copy:
    the only [V, H] tensors created are the first chunk's product (fp32) and the weight-dtype
    gradient."""
    h, w, y = _inputs(torch.bfloat16, seed=2)

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (V, H):
                self.ops.append((func.__name__.split(".")[0], out.dtype))
            return out

    with Record() as rec:
        linear_cross_entropy(h, w, y, max_chunk_elements=CHUNK).backward()
    names = [n for n, _ in rec.ops]
    assert "zeros" not in names and "zero_" not in names and "fill_" not in names, rec.ops
    fp32_new = [(n, d) for n, d in rec.ops if d == torch.float32 and not n.endswith("_")]
    assert fp32_new == [("_to_copy", torch.float32)], rec.ops   # the first chunk's product, on CPU
    assert ("mul", torch.bfloat16) in rec.ops                   # scaled straight into bf16


def test_every_target_ignored_is_zero_not_nan():
    h, w, y = _inputs(torch.float32)
    loss = linear_cross_entropy(h, w, torch.full_like(y, -100))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(h.grad, torch.zeros_like(h))


class _LargestVocabTensor(TorchDispatchMode):
    """Records the element count of every op output whose last dim is V (the logits' shape)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(o, torch.Tensor) and o.dim() == 2 and o.shape[-1] == VB and o.shape[0] != VB:
                self.sizes.append(o.numel())
        return out


TB, VB, HB = 512, 300, 8      # the [T, V] logits would be 153,600 elements


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tensor_larger_than_one_chunk_of_logits(dtype):
    """By construction: every [rows, V] tensor that forward and backward create has at most
    max_chunk_elements elements (the reference path would create [T, V] ones)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(TB, HB, generator=g).to(dtype).requires_grad_()
    w = torch.randn(VB, HB, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, VB, (TB,), generator=g)
    budget = 40 * VB + 7
    with _LargestVocabTensor() as spy:
        linear_cross_entropy(h, w, y, max_chunk_elements=budget).backward()
    assert spy.sizes and max(spy.sizes) <= budget, max(spy.sizes)
    assert max(spy.sizes) == 40 * VB           # the chunk size is what was asked for
    with _LargestVocabTensor() as ref:
        F.cross_entropy(h.float() @ w.float().t(), y).backward()
    assert max(ref.sizes) == TB * VB           # the spy does see full logits


def test_no_grad_computes_no_gradient():
    h, w, y = _inputs(torch.float32)

    class CountMM(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountMM.n += func.__name__.startswith(("mm", "addmm"))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), CountMM():
        loss = linear_cross_entropy(h, w, y, max_chunk_elements=CHUNK)
    assert CountMM.n == 5                      # one logits GEMM per chunk, no gradient GEMMs
    want, _, _ = _reference(h, w, y)
    assert not loss.requires_grad and h.grad is None
    torch.testing.assert_close(loss.double(), want, rtol=2e-5, atol=0)


def test_autocast_bf16_matches_bf16_inputs():
    h, w, y = _inputs(torch.float32, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, y, max_chunk_elements=CHUNK)
    loss.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32   # fp32 master weights
    _, dh, dw = _reference(h.detach().bfloat16(), w.detach().bfloat16(), y)
    want, _, _ = _reference(h.detach().bfloat16(), w.detach().bfloat16(), y)
    torch.testing.assert_close(loss.double(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad.double(), dw, rtol=2e-2, atol=2e-2 * dw.abs().max().item())


def test_bad_inputs_raise():
    h, w, y = _inputs(torch.float32)
    bad = y.clone()
    bad[3] = V
    with pytest.raises(RuntimeError, match="outside"):
        linear_cross_entropy(h, w, bad)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, w[:, :4], y)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, y[:5])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y, reduction="none")


def test_resolve_loss_impl():
    assert resolve_loss_impl("torch", "cpu")[0] == "torch"
    impl, note = resolve_loss_impl("auto", "cpu")
    assert impl == "torch" and "auto" in note
    with pytest.raises(ConfigError, match="liger"):
        resolve_loss_impl("liger", "cpu")
    with pytest.raises(ConfigError, match="train.loss_impl='fast'"):
        resolve_loss_impl("fast", "cpu")


def test_auto_loss_impl_on_cuda_prefers_liger_unless_the_step_is_a_cuda_graph(monkeypatch):
    """``auto`` on CUDA with Liger-Kernel importable: ``liger``; with ``train.cuda_graph=true``: ``torch``
    and a note saying why (Liger's loss reads a host value inside forward; a capture forbids it)."""
    from dropless.model import loss

    monkeypatch.setattr(loss, "_liger_class", lambda: object)   # as if liger_kernel imported
    assert resolve_loss_impl("auto", "cuda")[0] == "liger"
    impl, note = resolve_loss_impl("auto", "cuda", cuda_graph=True)
    assert impl == "torch" and "cuda_graph" in note
    monkeypatch.setattr(loss, "_liger_class", lambda: None)
    note = resolve_loss_impl("auto", "cuda", cuda_graph=True)[1]
    assert note.endswith("(train.loss_impl=auto: liger_kernel not installed)")
    with pytest.raises(ConfigError, match="runs on CUDA, this run is on cpu"):   # the device first
        resolve_loss_impl("liger", "cpu")
    monkeypatch.setattr(loss, "_liger_class", lambda: object)
    assert resolve_loss_impl("liger", "cuda")[0] == "liger"
    with pytest.raises(ConfigError, match="cuda_graph=true"):   # asked for by name: refused, not swapped
        resolve_loss_impl("liger", "cuda", cuda_graph=True)


@pytest.mark.gpu
def test_liger_matches_the_torch_path_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("liger_kernel")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1000, 256, generator=g).cuda().bfloat16().requires_grad_()
    w = (torch.randn(5003, 256, generator=g) * 0.05).cuda().bfloat16().requires_grad_()
    y = torch.randint(0, 5003, (1000,), generator=g).cuda()
    y[::7] = -100
    out = {}
    for impl in ("torch", "liger"):
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, y, impl=impl)
        loss.backward()
        out[impl] = (loss.float(), h.grad.float(), w.grad.float())
    for a, b in zip(out["liger"], out["torch"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


@pytest.mark.gpu
def test_bf16_on_cuda_accumulates_dw_over_many_chunks_like_float64():
    """CUDA sums each chunk's bf16 ``dW`` product in fp32 inside the GEMM (``addmm(out_dtype=float32)``,
    accumulating into the fp32 buffer): over 33 chunks, loss and gradients match float64."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(3)
    t, v, hd = 4100, 5003, 256
    h = torch.randn(t, hd, generator=g).cuda().bfloat16().requires_grad_()
    w = (torch.randn(v, hd, generator=g) * 0.05).cuda().bfloat16().requires_grad_()
    y = torch.randint(0, v, (t,), generator=g).cuda()
    y[::11] = -100
    loss = linear_cross_entropy(h, w, y, max_chunk_elements=125 * v)  # 125 rows: 33 chunks
    loss.backward()
    want, dh, dw = _reference(h.cpu(), w.cpu(), y.cpu())
    torch.testing.assert_close(loss.double().cpu(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h.grad.double().cpu(), dh, rtol=2e-2, atol=2e-2 * dh.abs().max().item())
    torch.testing.assert_close(w.grad.double().cpu(), dw, rtol=2e-2, atol=2e-2 * dw.abs().max().item())
