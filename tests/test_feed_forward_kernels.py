"""FeedForward's gate‖up form (:func:`dropless.mlp.gate_up_kernels`): one GEMM for ``[w1; w3]``, the
SwiGLU kernels of :mod:`dropless.ops.swiglu`, against float64 autograd through the plain modules.

Runs on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, as ``.ci/run`` sets,
with :data:`dropless.ops.select.FORCE_TRITON`).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from dropless import mlp
from dropless.mlp import FeedForward
from dropless.ops import select

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = select.HAS_TRITON and (DEV == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
pytestmark = pytest.mark.skipif(not KERNEL, reason="no CUDA and Triton's interpreter is off")


def _bf16_and_float64_modules(H, Fh, gen):
    """A bf16 FeedForward on DEV and a float64 copy holding the same (bf16-rounded) weights."""
    m = FeedForward(H, Fh)
    with torch.no_grad():
        for lin in (m.w1, m.w3, m.w2):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.3)
    m = m.to(DEV, torch.bfloat16)
    m64 = FeedForward(H, Fh).double()
    m64.load_state_dict({k: w.double().cpu() for k, w in m.state_dict().items()})
    return m, m64


@pytest.mark.parametrize("needs_x_grad", [True, False])
def test_gate_up_form_equals_float64_plain_modules(monkeypatch, needs_x_grad):
    if DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)
    gen = torch.Generator().manual_seed(12)
    H, Fh, T = 32, 48, 37
    m, m64 = _bf16_and_float64_modules(H, Fh, gen)
    x = torch.randn(T, H, generator=gen).bfloat16().float()
    g = torch.randn(T, H, generator=gen).bfloat16().float()
    xb = x.to(DEV, torch.bfloat16).requires_grad_(needs_x_grad)
    assert mlp.gate_up_kernels(xb, Fh)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = m(xb)
    y.backward(g.to(DEV, torch.bfloat16))
    assert (T, 2 * Fh) in saved and not any(s in saved for s in [(T, Fh)])    # h13 saved, no [T, F] activation

    x64 = x.double().requires_grad_(needs_x_grad)
    y64 = m64.w2(F.silu(m64.w1(x64)) * m64.w3(x64))
    y64.backward(g.double())

    def close(got, want):  # bf16 roundings of the intermediates: within 2 % of the tensor's largest value
        torch.testing.assert_close(got.double().cpu(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))

    close(y, y64.detach())
    for lin, lin64 in ((m.w1, m64.w1), (m.w3, m64.w3), (m.w2, m64.w2)):
        close(lin.weight.grad, lin64.weight.grad)
    if needs_x_grad:
        close(xb.grad, x64.grad)


def test_hidden_width_not_a_multiple_of_8_keeps_the_plain_form(monkeypatch):
    if DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)
    x = torch.randn(4, 16, device=DEV, dtype=torch.bfloat16)
    assert not mlp.gate_up_kernels(x, 20) and mlp.gate_up_kernels(x, 24)
    assert not mlp.gate_up_kernels(x.float(), 24)                 # fp32: the plain form (torch's own ops)
    m = FeedForward(16, 20).to(DEV, torch.bfloat16)
    y = m(x)
    assert y.shape == (4, 16) and y.dtype == torch.bfloat16


def test_gate_up_form_second_order_gradients(monkeypatch):
    """A gradient penalty (create_graph=True) through the gate‖up form: d‖∂L/∂x‖²/dw1 and d/dx within bf16
    rounding of the float64 plain modules' (the backward takes the plain ops when recording a graph)."""
    if DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)
    gen = torch.Generator().manual_seed(14)
    H, Fh, T = 16, 32, 9
    m, m64 = _bf16_and_float64_modules(H, Fh, gen)
    x0 = torch.randn(T, H, generator=gen).bfloat16()
    v = torch.randn(T, H, generator=gen).bfloat16()
    assert mlp.gate_up_kernels(x0.to(DEV), Fh)

    def penalty_grads(mod, x, vv, plain):
        x = x.clone().requires_grad_()
        y = mod.w2(F.silu(mod.w1(x)) * mod.w3(x)) if plain else mod(x)
        (gx,) = torch.autograd.grad((y * vv).sum(), x, create_graph=True)
        return torch.autograd.grad((gx.float() ** 2).sum(), [x, mod.w1.weight])

    got = penalty_grads(m, x0.to(DEV), v.to(DEV), plain=False)
    want = penalty_grads(m64, x0.double(), v.double(), plain=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double().cpu(), b, rtol=3e-2, atol=3e-2 * float(b.abs().max()))
