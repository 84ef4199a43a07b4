"""The chunk cross-entropy kernel (:mod:`dropless.ops.softmax_ce`) against a float64 reference.

Runs on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, as ``.ci/run``
sets); the torch reference path runs everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from dropless.ops import select
from dropless.ops.softmax_ce import softmax_ce_grad_, softmax_ce_grad_torch_

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = select.HAS_TRITON and (DEV == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def _ref(z, t, w):
    z64 = z.double()
    lse = torch.logsumexp(z64, 1)
    loss = lse - z64.gather(1, t[:, None])[:, 0]
    g = torch.softmax(z64, 1)
    g[torch.arange(z.shape[0]), t] -= 1
    return loss, g * w.double()[:, None]


def _inputs(c, v, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(c, v, generator=gen) * 4).to(dtype)
    z[1, 7] = 30.0                        # one dominant logit (the exp of the rest underflows in fp32)
    t = torch.randint(0, v, (c,), generator=gen)
    w = torch.full((c,), 1.0 / c)
    w[2] = 0.0                            # an ignored row: zero gradient, loss still defined
    return z.to(DEV), t.to(DEV), w.to(DEV)


@pytest.mark.parametrize("path", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not KERNEL, reason="no CUDA and Triton's interpreter is off"))])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("v", [1000, 4097])  # not a power of two; one more than a column block
def test_loss_and_gradient_equal_float64_reference(monkeypatch, path, dtype, tol, v):
    if path == "triton" and DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)
    if path == "torch":
        monkeypatch.setattr(select, "use_triton", lambda t: False)
    import dropless.ops.softmax_ce as sce
    monkeypatch.setattr(sce, "select", select)
    z, t, w = _inputs(5, v, dtype)
    want_loss, want_g = _ref(z, t, w)
    z_in = z.clone()
    loss = softmax_ce_grad_(z_in, t, w, grad=True)
    assert loss.dtype == torch.float32 and loss.shape == (5,)
    torch.testing.assert_close(loss.double(), want_loss, rtol=tol, atol=tol)
    assert z_in.dtype == dtype
    torch.testing.assert_close(z_in.double(), want_g, rtol=tol, atol=tol * float(w.max()))
    assert torch.equal(z_in[2], torch.zeros_like(z_in[2]))       # weight 0: no gradient
    z_keep = z.clone()
    loss2 = softmax_ce_grad_(z_keep, t, w, grad=False)             # loss only: logits untouched
    assert torch.equal(z_keep, z)
    torch.testing.assert_close(loss2, loss, rtol=1e-6, atol=1e-6)


def test_float64_runs_the_reference_and_bad_shapes_raise():
    z, t, w = _inputs(4, 33, torch.float64)
    loss = softmax_ce_grad_(z, t, w, grad=False)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, _ref(z, t, w)[0])
    with pytest.raises(ValueError, match=r"\[C, V\]"):
        softmax_ce_grad_(z, t[:3], w)
    zg = z.clone()
    softmax_ce_grad_torch_(zg, t, w, grad=True)                   # the reference path itself, float64
    torch.testing.assert_close(zg, _ref(z, t, w)[1], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"\[C, V\]"):
        softmax_ce_grad_(z[0], t, w)
