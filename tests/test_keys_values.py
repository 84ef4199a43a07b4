"""MLA's keys and values (:mod:`dropless.ops.keys_values`) against the plain ``split`` + ``expand`` + ``cat``.

The Triton kernels run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, as ``.ci/run``
sets, with :data:`dropless.ops.select.FORCE_TRITON`; without it ``test_kernel_cases_under_the_interpreter``
reruns this file so); the torch reference runs everywhere. ``k`` and ``kv``'s gradient are copies: bitwise
the plain expression's. The rope key's gradient is a head sum in fp32: float64 (the reference) bitwise,
fp32 within 1e-6, 16-bit within one rounding step of torch's sum (the interpreter rounds fp32 -> bf16
toward zero, compiled Triton to nearest; the order of the sum may differ) and of the float64 sum.
"""

from __future__ import annotations

import pytest
import torch

from dropless.model.attention import keys_values
from dropless.ops import keys_values as kvm
from dropless.ops import select
from tests.conftest import rerun_under_interpreter

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
KERNEL_HERE = select.HAS_TRITON and (CUDA or select.interpreting())  # the kernels can run in this process
needs_kernel = pytest.mark.skipif(not KERNEL_HERE, reason="no CUDA and Triton's interpreter is off "
                                  "(test_kernel_cases_under_the_interpreter runs these in a subprocess)")
PATHS = ["torch", pytest.param("triton", marks=needs_kernel)]
# (N, Dn, Dv, Dr): recipe h200_single's head; not powers of two (24 + 8 = 32, 24 + 40 = 64: odd only per part);
# odd everywhere; no nope part; no value or rope part
SHAPES = [(16, 64, 64, 32), (3, 24, 40, 8), (5, 7, 9, 3), (2, 0, 5, 3), (2, 6, 0, 0)]


def _path(monkeypatch, path, dtype=None):
    """Pick the path; on the Triton path with a kernel dtype the references must not run."""
    if path == "torch":
        monkeypatch.setattr(select, "use_triton", lambda t: False)
        return
    if DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)
    if dtype in (torch.bfloat16, torch.float16, torch.float32):
        def boom(*args, **kwargs):
            raise AssertionError("the torch reference ran on the kernel path")
        monkeypatch.setattr(kvm, "keys_forward_torch", boom)
        monkeypatch.setattr(kvm, "keys_values_backward_torch", boom)


def _inputs(B, S, N, Dn, Dv, Dr, dtype, layout, seed=0):
    """kv, k_pe and the gradients gk, gv in ``layout``: ``contiguous``; ``strided`` (kv a slice of a wider
    GEMM output, k_pe a slice of ``wkv_a``'s with B and S swapped in memory, gk and gv ``[B, N, S, D]`` in
    memory as SDPA returns them); ``last`` (gk and gv with a last-dim stride of 2)."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEV)

    if layout == "contiguous":
        return r(B, S, N, Dn + Dv), r(B, S, 1, Dr), r(B, S, N, Dn + Dr), r(B, S, N, Dv)
    if layout == "strided":
        kv = r(B, S, N, Dn + Dv + 4)[..., 2:2 + Dn + Dv]
        pe = r(S, B, 1, Dr + 5).transpose(0, 1)[..., 3:3 + Dr]
        return kv, pe, r(B, N, S, Dn + Dr).transpose(1, 2), r(B, N, S, Dv).transpose(1, 2)
    return r(B, S, N, Dn + Dv), r(B, S, 1, Dr), r(B, S, N, 2 * (Dn + Dr))[..., ::2], r(B, S, N, 2 * Dv)[..., ::2]


def _plain(kv, pe, Dn):
    """The plain differentiable expression."""
    B, S, N, X = kv.shape
    k_nope, v = torch.split(kv, [Dn, X - Dn], dim=-1)
    return torch.cat([k_nope, pe.expand(B, S, N, pe.shape[-1])], dim=-1), v


def _ordered(x):
    """bf16/fp16 bit patterns as integers in the order of the values (±0 both 0)."""
    i = x.view(torch.int16).int()
    return torch.where(i < 0, -(i & 0x7FFF), i)


def _check_rope_grad(got, want, gk, Dn):
    """``got`` (the rope key's gradient) against torch's ``want``: float64 bitwise; fp32 within 1e-6; 16-bit
    at most one rounding step from torch's and within one step of the float64 head sum."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    if got.numel() == 0:
        return
    if got.dtype == torch.float64:
        assert torch.equal(got, want)
    elif got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max().clamp_min(1)))
    else:
        assert (_ordered(got) - _ordered(want)).abs().max() <= 1
        exact = gk[..., Dn:].double().sum(2, keepdim=True)
        fp32_error = gk[..., Dn:].double().abs().sum(2, keepdim=True) * 2.0 ** -20   # the head sum's, at most
        step = 2.0 ** -7 if got.dtype == torch.bfloat16 else 2.0 ** -10
        assert ((got.double() - exact).abs() <= step * exact.abs() + fp32_error).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,Dn,Dv,Dr", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "last"])
def test_forward_and_backward_equal_the_plain_expression(monkeypatch, path, dtype, N, Dn, Dv, Dr, layout):
    """k bitwise ``cat``, v a view of kv; kv's gradient bitwise autograd's, the rope key's as
    :func:`_check_rope_grad`; 2·5 = 10 token rows: not a multiple of the kernels' row block."""
    _path(monkeypatch, path, dtype)
    B, S = 2, 5
    kv, pe, gk, gv = _inputs(B, S, N, Dn, Dv, Dr, dtype, layout)
    kv, pe = kv.requires_grad_(), pe.requires_grad_()
    k, v = keys_values(kv, pe, Dn)
    kv2, pe2 = kv.detach().clone().requires_grad_(), pe.detach().clone().requires_grad_()
    k2, v2 = _plain(kv2, pe2, Dn)
    assert k.dtype == dtype and k.is_contiguous() and torch.equal(k, k2)
    assert torch.equal(v, v2) and v.data_ptr() == kv[..., Dn:].data_ptr() and v.stride() == kv.stride()
    got = torch.autograd.grad((k, v), (kv, pe), (gk, gv))
    want = torch.autograd.grad((k2, v2), (kv2, pe2), (gk, gv))
    assert got[0].is_contiguous() and torch.equal(got[0], want[0])
    _check_rope_grad(got[1], want[1], gk, Dn)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("used", ["k", "v"])
def test_one_output_used(monkeypatch, path, dtype, used):
    """Only k or only v reaches the loss: the other part of kv's gradient is exactly 0 (not stale memory),
    and k_pe gets no gradient when only v is used."""
    _path(monkeypatch, path, dtype)
    N, Dn, Dv, Dr = 3, 24, 40, 8
    kv, pe, gk, gv = _inputs(2, 5, N, Dn, Dv, Dr, dtype, "strided", seed=1)
    kv, pe = kv.requires_grad_(), pe.requires_grad_()
    k, v = keys_values(kv, pe, Dn)
    kv2, pe2 = kv.detach().clone().requires_grad_(), pe.detach().clone().requires_grad_()
    k2, v2 = _plain(kv2, pe2, Dn)
    out, out2, g = (k, k2, gk) if used == "k" else (v, v2, gv)
    got = torch.autograd.grad(out, (kv, pe), g, allow_unused=True)
    want = torch.autograd.grad(out2, (kv2, pe2), g, allow_unused=True)
    assert torch.equal(got[0], want[0])
    zero = got[0][..., Dn:] if used == "k" else got[0][..., :Dn]
    assert torch.equal(zero, torch.zeros_like(zero))
    if used == "v":
        assert got[1] is None and want[1] is None
    else:
        _check_rope_grad(got[1], want[1], gk, Dn)


@pytest.mark.parametrize("path", PATHS)
def test_backward_function_none_and_empty(monkeypatch, path):
    """keys_values_backward: no gradient at all gives (None, None); no token rows give empty gradients."""
    _path(monkeypatch, path, torch.bfloat16)
    with torch.no_grad():
        assert kvm.keys_values_backward(None, None, 4, 6, torch.bfloat16, torch.bfloat16) == (None, None)
        kv, pe, gk, gv = _inputs(0, 5, 3, 4, 6, 2, torch.bfloat16, "contiguous")
        assert kvm.keys_forward(kv, pe, 4).shape == (0, 5, 3, 6)
        gkv, gpe = kvm.keys_values_backward(gk, gv, 4, 6, torch.bfloat16, torch.bfloat16)
    assert gkv.shape == (0, 5, 3, 10) and gpe.shape == (0, 5, 1, 2)


@pytest.mark.parametrize("path", PATHS)
def test_mixed_dtypes_promote_as_cat(monkeypatch, path):
    """kv bf16 with an fp32 rope key (not a kernel case: the reference runs): k in fp32 as ``cat``; the
    gradients in the inputs' dtypes, equal to autograd's through the plain expression."""
    _path(monkeypatch, path)
    kv, pe, gk, gv = _inputs(2, 5, 3, 4, 6, 2, torch.bfloat16, "contiguous")
    kv, pe = kv.requires_grad_(), pe.float().requires_grad_()
    k, v = keys_values(kv, pe, 4)
    k2, v2 = _plain(kv, pe, 4)
    assert k.dtype == torch.float32 and torch.equal(k, k2)
    got = torch.autograd.grad((k, v), (kv, pe), (gk.float(), gv))
    want = torch.autograd.grad((k2, v2), (kv, pe), (gk.float(), gv))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("path", PATHS)
def test_create_graph_backward_is_differentiable(monkeypatch, path):
    """A backward with ``create_graph=True`` (the kernel forward, the reference backward): second-order
    gradients equal the plain expression's (fp32, to its last bits)."""
    _path(monkeypatch, path)
    kv, pe, _, _ = _inputs(2, 5, 3, 4, 6, 2, torch.float32, "strided", seed=2)
    grads = []
    for fn in (keys_values, _plain):
        a, b = kv.detach().clone().requires_grad_(), pe.detach().clone().requires_grad_()
        k, v = fn(a, b, 4)
        ga, gb = torch.autograd.grad((k ** 3).sum() + (v ** 3).sum(), (a, b), create_graph=True)
        grads.append(torch.autograd.grad((ga ** 2).sum() + (gb ** 2).sum(), (a, b)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_gradcheck_gradgradcheck_and_torch_func_float64():
    """Through attention's keys_values on the CPU (the reference): gradients and second-order gradients
    against finite differences, an unused output included; ``torch.func.grad`` (the plain expression)
    equals autograd through the Function."""
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(2, 3, 3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    pe = torch.randn(2, 3, 1, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: keys_values(a, b, 3), (kv, pe))
    assert torch.autograd.gradgradcheck(lambda a, b: keys_values(a, b, 3), (kv, pe))
    assert torch.autograd.gradcheck(lambda a, b: keys_values(a, b, 3)[0], (kv, pe))

    def loss(a, b):
        k, v = keys_values(a, b, 3)
        return (k ** 2).sum() + (v ** 3).sum()

    got = torch.func.grad(loss, argnums=(0, 1))(kv.detach(), pe.detach())
    want = torch.autograd.grad(loss(kv, pe), (kv, pe))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_bad_shapes_raise():
    kv = torch.randn(2, 3, 4, 10)
    with pytest.raises(ValueError, match=r"k_pe \[B, S, 1, Dr\]"):
        keys_values(kv, torch.randn(2, 3, 4, 2), 4)
    with pytest.raises(ValueError, match="nope_dim=11"):
        keys_values(kv, torch.randn(2, 3, 1, 2), 11)
    with pytest.raises(ValueError, match=r"\[B, S, N, Dn \+ Dv\]"):
        keys_values(kv[0], torch.randn(3, 1, 2), 4)
    with pytest.raises(ValueError, match="nope_dim must be an int"):   # not a TypeError from inside
        keys_values(kv, torch.randn(2, 3, 1, 2), 4.0)


@pytest.mark.skipif(not select.HAS_TRITON or KERNEL_HERE, reason="triton missing, or the kernels run here")
def test_kernel_cases_under_the_interpreter():
    """This file again with ``TRITON_INTERPRET=1``: the kernel cases above run on the CPU."""
    rerun_under_interpreter(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not select.HAS_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("config", [None, (8, 8), (1, 4)])
def test_kernels_at_the_recipe_shape_on_cuda(config):
    """recipe=h200_single's MLA (N=16, Dn=Dv=64, Dr=32, bf16) at B=2, S=2048, the gradients as SDPA
    returns them, with the default and two other launch configurations; no host sync."""
    B, S, N, Dn, Dv, Dr = 2, 2048, 16, 64, 64, 32
    kv, pe, gk, gv = _inputs(B, S, N, Dn, Dv, Dr, torch.bfloat16, "strided", seed=5)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            k = kvm.keys_forward(kv, pe, Dn, config=config)
            gkv, gpe = kvm.keys_values_backward(gk, gv, Dn, Dv, torch.bfloat16, torch.bfloat16, config=config)
            gkv_k, _ = kvm.keys_values_backward(gk, None, Dn, Dv, torch.bfloat16, torch.bfloat16, config=config)
            gkv_v, gpe_v = kvm.keys_values_backward(None, gv, Dn, Dv, torch.bfloat16, torch.bfloat16, config=config)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    k2, _ = _plain(kv, pe, Dn)
    assert torch.equal(k, k2)
    assert torch.equal(gkv, torch.cat([gk[..., :Dn], gv], -1))
    assert torch.equal(gkv_k, torch.cat([gk[..., :Dn], torch.zeros_like(gv)], -1))
    assert torch.equal(gkv_v, torch.cat([torch.zeros_like(gk[..., :Dn]), gv], -1)) and gpe_v is None
    _check_rope_grad(gpe, gk[..., Dn:].sum(2, keepdim=True), gk, Dn)
