"""RMSNorm's one-pass backward (:mod:`dropless.ops.rms_norm`) and the module's autograd Function that uses it.

The kernel runs on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, as ``.ci/run``
sets, with :data:`dropless.ops.select.FORCE_TRITON`); the torch reference path runs everywhere. The
reference for both is torch autograd through ``F.rms_norm`` in float64. The bf16 tolerances are one bf16
ulp: the interpreter rounds the kernel's fp32 -> bf16 stores toward zero (compiled Triton rounds to nearest).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from dropless.model import RMSNorm
from dropless.ops import select
from dropless.ops.rms_norm import (
    _AddRMSNormFn,
    _RMSNormFn,
    add_rms_norm,
    add_rms_norm_forward,
    rms_norm,
    rms_norm_backward,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = select.HAS_TRITON and (DEV == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
needs_kernel = pytest.mark.skipif(not KERNEL, reason="no CUDA and Triton's interpreter is off")
EPS = 1e-6


def _ref(dy, x, w, eps=EPS):
    """float64 ``(dx, dw)`` by autograd through ``F.rms_norm``."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = F.rms_norm(x64, (x.shape[-1],), w64, eps)
    return torch.autograd.grad(y, (x64, w64), dy.double())


def _inputs(r, d, dtype, wdtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(r, d, generator=gen) * 3 + torch.randn(r, 1, generator=gen)).to(dtype)
    dy = torch.randn(r, d, generator=gen).to(dtype)
    w = (torch.rand(d, generator=gen) * 1.5 + 0.5).to(wdtype or dtype)
    return dy.to(DEV), x.to(DEV), w.to(DEV)


def _close(got, want, tol):
    """Within ``tol`` of the float64 value, relative to it and to the tensor's largest magnitude."""
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


def _force(monkeypatch, path):
    if path == "triton" and DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)
    if path == "torch":
        monkeypatch.setattr(select, "use_triton", lambda t: False)


PATHS = ["torch", pytest.param("triton", marks=needs_kernel)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,wdtype,tol", [(torch.float32, None, 2e-5), (torch.bfloat16, None, 8e-3),
                                              (torch.bfloat16, torch.float32, 8e-3)])
@pytest.mark.parametrize("d", [256, 100])          # a power of two; not one
@pytest.mark.parametrize("r", [1, 37, 300])         # one row; not a multiple of the row block; several programs
def test_backward_equals_float64_autograd(monkeypatch, path, dtype, wdtype, tol, d, r):
    _force(monkeypatch, path)
    dy, x, w = _inputs(r, d, dtype, wdtype)
    dx, dw = rms_norm_backward(dy, x, w, EPS)
    want_dx, want_dw = _ref(dy, x, w)
    assert dx.dtype == x.dtype and dx.shape == x.shape and dx.is_contiguous()
    assert dw.dtype == w.dtype and dw.shape == w.shape
    _close(dx, want_dx, tol)
    _close(dw, want_dw, tol)


@pytest.mark.parametrize("path", PATHS)
def test_empty_strided_and_expanded_inputs(monkeypatch, path):
    """No rows: empty dx and a zero dw. Rows with a stride (a column slice of a wider tensor, as MLA's
    ``kv_norm`` reads) and a broadcast gradient (stride 0) give the contiguous inputs' result."""
    _force(monkeypatch, path)
    dy, x, w = _inputs(0, 64, torch.float32)
    dx, dw = rms_norm_backward(dy, x, w, EPS)
    assert dx.shape == (0, 64) and torch.equal(dw, torch.zeros_like(w))
    dy, x, w = _inputs(5, 0, torch.float32)                            # no feature: empty results, no launch
    dx, dw = rms_norm_backward(dy, x, w, EPS)
    assert dx.shape == (5, 0) and dw.shape == (0,)
    x0 = x.clone().requires_grad_()
    rms_norm(x0, w, EPS).sum().backward()
    assert x0.grad.shape == (5, 0)
    dy, x, w = _inputs(45, 80, torch.bfloat16)
    wide = torch.cat([x, x[:, :16]], dim=1)[:, :80]                     # row stride 96
    dy0 = dy[:1].expand(45, 80)                                          # row stride 0
    dx, dw = rms_norm_backward(dy0, wide, w, EPS)
    want_dx, want_dw = rms_norm_backward(dy0.contiguous(), x.contiguous(), w, EPS)
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
    torch.testing.assert_close(dw, want_dw, rtol=1e-2, atol=0)            # the same sum, maybe another order
    dyt = dy.t().contiguous().t()                                        # strided columns: made contiguous
    _close(rms_norm_backward(dyt, x, w, EPS)[0], _ref(dy, x, w)[0], 8e-3)


def test_float64_runs_the_reference_and_bad_arguments_raise(monkeypatch):
    monkeypatch.setattr(select, "FORCE_TRITON", True)   # float64 never takes the kernel
    dy, x, w = _inputs(7, 24, torch.float64)
    dx, dw = rms_norm_backward(dy, x, w, EPS)
    want_dx, want_dw = _ref(dy, x, w)
    assert dx.dtype == dw.dtype == torch.float64
    torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, want_dw, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"\[R, D\]"):
        rms_norm_backward(dy, x, w[:5], EPS)
    with pytest.raises(ValueError, match=r"\[R, D\]"):
        rms_norm_backward(dy[0], x[0], w, EPS)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_backward(dy.float(), x, w, EPS)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_backward(dy.bfloat16(), x.bfloat16(), w.half(), EPS)


def test_function_gradcheck_and_gradgradcheck_float64():
    """The Function's backward (the reference in float64) and its create_graph backward are the derivatives."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 6, dtype=torch.float64, generator=gen).requires_grad_()
    w = (torch.rand(6, dtype=torch.float64, generator=gen) + 0.5).requires_grad_()
    fn = lambda x, w: _RMSNormFn.apply(x, w, EPS)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w))
    assert torch.autograd.gradgradcheck(fn, (x, w))


@needs_kernel
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                          (torch.float32, torch.float32)])
@pytest.mark.parametrize("shape", [(2, 19, 256), (0, 100)])
def test_module_gradients_equal_plain_rms_norm(monkeypatch, dtype, wdtype, shape):
    """The module through the Function: the output of F.rms_norm, gradients of x and weight within
    rounding of plain autograd's, and only x and the weight saved (no fp32 copy of a 16-bit x)."""
    gen = torch.Generator().manual_seed(2)
    d = shape[-1]
    norm = RMSNorm(d).to(DEV, wdtype)
    norm.weight.data = (torch.rand(d, generator=gen) + 0.5).to(DEV, wdtype)
    x = (torch.randn(shape, generator=gen) * 4).to(DEV, dtype)
    dy = torch.randn(shape, generator=gen).to(DEV, dtype)
    outs = []
    for path in ("torch", "triton"):
        _force(monkeypatch, path)
        xi = x.clone().requires_grad_()
        norm.weight.grad = None
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = norm(xi)
        assert ("RMSNormFn" in type(y.grad_fn).__name__) == (path == "triton")
        y.backward(dy)
        outs.append((y, xi.grad, norm.weight.grad, saved))
        monkeypatch.undo()
    (y0, gx0, gw0, _), (y1, gx1, gw1, saved) = outs
    assert torch.equal(y1, y0) and y1.dtype == dtype
    assert gx1.dtype == dtype and gw1.dtype == wdtype
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    _close(gx1, gx0.double(), tol)
    _close(gw1, gw0.double(), tol)
    assert [(t.dtype, t.shape) for t in saved] == [(dtype, x.shape), (wdtype, (d,))]


@needs_kernel
def test_create_graph_backward_and_torch_func(monkeypatch):
    """A create_graph backward through the Function (fp32, kernel path forced) is differentiable and
    equals plain autograd's; torch.func.grad falls back to plain F.rms_norm."""
    _force(monkeypatch, "triton")
    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(48).to(DEV)
    norm.weight.data = (torch.rand(48, generator=gen) + 0.5).to(DEV)
    x = torch.randn(5, 48, generator=gen).to(DEV)
    dy = torch.randn(5, 48, generator=gen).to(DEV)

    def second_order(y_fn):
        xi = x.clone().requires_grad_()
        y = y_fn(xi)
        gx, gw = torch.autograd.grad(y, (xi, norm.weight), dy, create_graph=True)
        return gx, gw, torch.autograd.grad(gx.square().sum() + (gw * gw).sum(), (xi, norm.weight))

    got = second_order(norm)
    want = second_order(lambda xi: F.rms_norm(xi, (48,), norm.weight, norm.eps))
    for a, b in zip((*got[:2], *got[2]), (*want[:2], *want[2])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    gfx = torch.func.grad(lambda xi: (norm(xi) * dy).sum())(x)
    torch.testing.assert_close(gfx, got[0].detach(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- add_rms_norm
def _add_inputs(r, d, dtype, wdtype=None, seed=5):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(r, d, generator=gen) * 3 + torch.randn(r, 1, generator=gen)).to(dtype)
    a = torch.randn(r, d, generator=gen).to(dtype)
    w = (torch.rand(d, generator=gen) * 1.5 + 0.5).to(wdtype or dtype)
    dh = torch.randn(r, d, generator=gen).to(dtype)
    dy = torch.randn(r, d, generator=gen).to(dtype)
    return [t.to(DEV) for t in (x, a, w, dh, dy)]


def _add_ref(x, a, w, dh, dy, eps=EPS):
    """float64 ``(h, y, dx, dw)`` of ``h = round(x + a)``, ``y = F.rms_norm(h)`` by autograd, for
    ``loss = Σ h·dh + y·dy`` (a None ``dh``/``dy`` contributes nothing); ``h`` rounded to ``x``'s
    dtype first, as the op stores it and its backward reads it."""
    h64 = (x + a).double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y = F.rms_norm(h64, (x.shape[-1],), w64, eps)
    loss = sum(((t * g.double()).sum() for t, g in ((h64, dh), (y, dy)) if g is not None),
               torch.zeros((), dtype=torch.float64))
    dx, dw = torch.autograd.grad(loss, (h64, w64), allow_unused=True)
    return h64.detach(), y.detach(), dx, dw


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,wdtype,tol", [(torch.float32, None, 2e-5), (torch.bfloat16, None, 8e-3),
                                              (torch.bfloat16, torch.float32, 8e-3)])
@pytest.mark.parametrize("r,d", [(1, 256), (37, 100), (300, 256)])
def test_add_rms_norm_equals_float64_autograd(monkeypatch, path, dtype, wdtype, tol, r, d):
    """h is x + a exactly as torch rounds it; y, dx (= da) and dw within rounding of float64 autograd of
    the two ops; the kernel path runs one autograd node that saves h and the weight only."""
    _force(monkeypatch, path)
    x, a, w, dh, dy = _add_inputs(r, d, dtype, wdtype)
    h, y = add_rms_norm_forward(x, a, w, EPS)
    assert h.is_contiguous() and y.dtype == h.dtype == dtype
    if DEV == "cuda" or path == "torch" or dtype == torch.float32:
        assert torch.equal(h, x + a)
    else:  # the interpreter rounds fp32 -> bf16 toward zero: one bf16 ulp
        torch.testing.assert_close(h, x + a, rtol=2 ** -7, atol=0)
    h64, y64, dx64, dw64 = _add_ref(x, a, w, dh, dy)
    _close(y, y64, tol)
    xi, ai, wi = x.clone().requires_grad_(), a.clone().requires_grad_(), w.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        hh, yy = add_rms_norm(xi.view(1, r, d), ai.view(1, r, d), wi, EPS)
    assert hh.shape == yy.shape == (1, r, d)
    assert ("AddRMSNormFn" in type(yy.grad_fn).__name__) == (path == "triton")
    if path == "triton":
        assert [(t.dtype, tuple(t.shape)) for t in saved] == [(dtype, (1, r, d)), (w.dtype, (d,))]
    torch.autograd.backward((hh, yy), (dh.view(1, r, d), dy.view(1, r, d)))
    assert torch.equal(hh.view(r, d), h)
    _close(yy.view(r, d), y64, tol)
    _close(xi.grad, dx64, tol)
    _close(ai.grad, dx64, tol)
    _close(wi.grad, dw64, tol)


@pytest.mark.parametrize("path", PATHS)
def test_add_rms_norm_with_one_output_used(monkeypatch, path):
    """Only y reaches the loss: dx is the norm's gradient alone; only h: dx = da = dh and no weight
    gradient; neither output needs the other's gradient materialised."""
    _force(monkeypatch, path)
    x, a, w, dh, dy = _add_inputs(29, 64, torch.float32)
    for use in ("y", "h"):
        xi, ai, wi = x.clone().requires_grad_(), a.clone().requires_grad_(), w.clone().requires_grad_()
        h, y = add_rms_norm(xi, ai, wi, EPS)
        (y if use == "y" else h).backward(dy if use == "y" else dh)
        _, _, dx64, dw64 = _add_ref(x, a, w, None if use == "y" else dh, dy if use == "y" else None)
        _close(xi.grad, dx64, 2e-5)
        _close(ai.grad, dx64, 2e-5)
        if use == "y":
            _close(wi.grad, dw64, 2e-5)
        else:
            assert wi.grad is None


def test_add_rms_norm_function_gradcheck_and_bad_arguments(monkeypatch):
    """float64 (the torch ops inside the Function) passes gradcheck and gradgradcheck; mismatched
    shapes or dtypes raise ValueError naming what is wrong."""
    monkeypatch.setattr(select, "FORCE_TRITON", True)   # float64 never takes the kernel
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, 6, dtype=torch.float64, generator=gen).requires_grad_()
    a = torch.randn(3, 4, 6, dtype=torch.float64, generator=gen).requires_grad_()
    w = (torch.rand(6, dtype=torch.float64, generator=gen) + 0.5).requires_grad_()
    fn = lambda x, a, w: _AddRMSNormFn.apply(x, a, w, EPS)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, a, w))
    assert torch.autograd.gradgradcheck(fn, (x, a, w))
    x2, a2 = x.detach()[0], a.detach()[0]
    with pytest.raises(ValueError, match=r"\[R, D\]"):
        add_rms_norm_forward(x2, a2[:3], w.detach(), EPS)
    with pytest.raises(ValueError, match="dtype"):
        add_rms_norm_forward(x2, a2.float(), w.detach(), EPS)
    with pytest.raises(ValueError, match="residual_grad"):
        rms_norm_backward(x2, x2, w.detach(), EPS, residual_grad=a2.float())
    with pytest.raises(ValueError, match="floating-point"):            # not a silently wrong integer norm
        add_rms_norm_forward(torch.ones(1, 3, dtype=torch.int64), torch.ones(1, 3, dtype=torch.int64),
                             torch.ones(3, dtype=torch.int64), EPS)
    for op in (lambda: add_rms_norm(x.detach(), a.detach(), w.detach()[:5], EPS),
               lambda: rms_norm(x.detach(), w.detach()[:5], EPS)):   # one message on every path
        with pytest.raises(ValueError, match=r"weight must be \[D\] for x \[\.\.\., D\]"):
            op()
    dx, _ = rms_norm_backward(x2[:, ::2], x2[:, ::2], w.detach()[:3], EPS)   # strided columns, torch path
    assert dx.is_contiguous()


@needs_kernel
def test_block_forward_add_equals_the_separate_ops(monkeypatch):
    """A decoder block (bf16) through the fused op gives the plain ops' output and gradients within rounding."""
    from dropless.config import ModelArgs
    from dropless.model.rope import rope_cos_sin
    from dropless.model.transformer import Block

    args = ModelArgs()                                   # the tiny default: one dense layer first
    torch.manual_seed(0)
    block = Block(args, 0).to(DEV)
    block.attention.init_weights(0.1)
    block.to(torch.bfloat16)
    cos, sin = rope_cos_sin(12, args.qk_rope_head_dim, args.rope_theta, device=DEV)
    H = args.hidden_size
    x = torch.randn(2, 12, H, device=DEV).to(torch.bfloat16)
    dy = torch.randn(2, 12, H, device=DEV).to(torch.bfloat16)
    got = []
    for path in ("torch", "triton"):
        _force(monkeypatch, path)
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out, _ = block(xi, cos, sin)
        out.backward(dy)
        got.append((out.float(), xi.grad.float(), block.ffn_norm.weight.grad.float()))
        monkeypatch.undo()
    for want, have in zip(*got):
        torch.testing.assert_close(have, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
