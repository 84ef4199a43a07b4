"""The RoPE-tail kernel (:mod:`dropless.ops.rope_tail`) against a float64 reference.

The Triton kernel runs on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``,
as ``.ci/run`` sets); the torch paths run everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from dropless.model.rope import apply_rope, rope_cos_sin, rope_tail
from dropless.ops import select
from dropless.ops.rope_tail import rotate_tail

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = select.HAS_TRITON and (DEV == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
PATHS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not KERNEL, reason="no CUDA and Triton's "
                                                                                       "interpreter is off"))]


def _path(monkeypatch, path):
    if path == "triton" and DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)
    if path == "torch":
        monkeypatch.setattr(select, "use_triton", lambda t: False)


def _ref(x, cos, sin, sign):
    """[x[..., :n] | apply_rope(x[..., n:])] in float64, by ``sign``·angle."""
    n = x.shape[-1] - 2 * cos.shape[1]
    x64 = x.double()
    return torch.cat([x64[..., :n], apply_rope(x64[..., n:], cos.double(), sign * sin.double())], -1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3), (torch.float64, 1e-13)])
@pytest.mark.parametrize("n_head,R", [(64, 32), (0, 32), (6, 6)])   # MLA's q and k_pe; a head and P not powers of 2
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("layout", ["contiguous", "BNSD"])           # BNSD: the gradient SDPA returns, transposed
def test_rotate_tail_equals_float64_reference(monkeypatch, path, dtype, tol, n_head, R, sign, layout):
    _path(monkeypatch, path)
    gen = torch.Generator().manual_seed(3)
    B, S, N, D = 2, 5, 3, n_head + R        # 30 rows: not a multiple of the kernel's row block
    cos, sin = rope_cos_sin(S, R, 10000.0, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    x = (torch.randn(B, S, N, D, generator=gen) * 3).to(dtype)
    if layout == "BNSD":
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    x, cos, sin = x.to(DEV), cos.to(DEV), sin.to(DEV)
    with torch.no_grad():
        out = rotate_tail(x, cos, sin, sign)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out[..., :n_head], x[..., :n_head])                       # the head: copied bit for bit
    want = _ref(x, cos, sin, sign)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    # rounded once from the compute dtype: the result within one bf16 step of the exact rotation
    if dtype == torch.bfloat16:
        assert torch.equal(out, want.to(dtype)) or (out.double() - want).abs().max() <= 2 ** -7 * want.abs().max()


@pytest.mark.parametrize("path", PATHS)
def test_rope_tail_forward_and_backward_equal_torch_path(monkeypatch, path):
    """rope_tail (the autograd Function: forward and backward through rotate_tail) in bf16 equals the
    torch path's result to bf16 rounding; x's gradient is the rotation by −angle of the output's."""
    _path(monkeypatch, path)
    gen = torch.Generator().manual_seed(5)
    B, S, N, n, R = 2, 9, 4, 8, 8
    cos, sin = (t.to(DEV) for t in rope_cos_sin(S, R, 10000.0))
    x = torch.randn(B, S, N, n + R, generator=gen).to(torch.bfloat16).to(DEV).requires_grad_()
    g = torch.randn(B, N, S, n + R, generator=gen).to(torch.bfloat16).to(DEV).transpose(1, 2)
    y = rope_tail(x, cos, sin)
    (gx,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(y.double(), _ref(x.detach(), cos, sin, 1.0), rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(gx.double(), _ref(g, cos, sin, -1.0), rtol=8e-3, atol=1e-2)


@pytest.mark.skipif(not KERNEL, reason="no CUDA and Triton's interpreter is off")
def test_kernel_and_torch_path_agree_and_empty_input(monkeypatch):
    """The kernel and the eager torch path on the same fp32 input: equal to the last bit of fp32 (either
    may fuse a multiply-add); an input with no rows gives an empty output without a launch."""
    if DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)
    gen = torch.Generator().manual_seed(6)
    cos, sin = (t.to(DEV) for t in rope_cos_sin(7, 32, 10000.0))
    x = torch.randn(3, 7, 2, 96, generator=gen).to(DEV)
    with torch.no_grad():
        got = rotate_tail(x, cos, sin, 1.0)
        monkeypatch.setattr(select, "use_triton", lambda t: False)
        want = rotate_tail(x, cos, sin, 1.0)
    torch.testing.assert_close(got, want, rtol=2e-7, atol=2e-7)
    monkeypatch.undo()
    if DEV == "cpu":
        monkeypatch.setattr(select, "FORCE_TRITON", True)
    with torch.no_grad():
        assert rotate_tail(x[:0], cos, sin, 1.0).shape == (0, 7, 2, 96)


@pytest.mark.parametrize("path", PATHS)
def test_empty_tables_copy_and_bad_x_raise(monkeypatch, path):
    """Tables with no pair (P = 0) give a copy of x on every path; an integer or a 3-D x is refused by
    rope_tail with a message naming what it needs."""
    _path(monkeypatch, path)
    x = torch.randn(2, 3, 2, 5, device=DEV)
    empty = torch.zeros(3, 0, device=DEV)
    with torch.no_grad():
        out = rotate_tail(x, empty, empty, 1.0)
    assert torch.equal(out, x) and out.is_contiguous()
    cos, sin = (t.to(DEV) for t in rope_cos_sin(3, 4, 10000.0))
    with pytest.raises(ValueError, match="floating-point"):
        rope_tail(torch.ones(2, 3, 2, 4, dtype=torch.int64, device=DEV), cos, sin)
    with pytest.raises(ValueError, match=r"\[B, S, N, D\]"):
        rope_tail(torch.randn(3, 2, 4, device=DEV), cos, sin)
