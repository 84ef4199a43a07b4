"""SwiGLU feed-forward network, shared by the dense decoder layers and the MoE's shared experts.

``FeedForward(dim, hidden_dim)(x) = w2( silu(w1 x) * w3 x )`` — the gated
linear unit with a SiLU gate of Shazeer, "GLU Variants Improve Transformer"
(2020), as used by DeepSeek-V3 for its dense layers (``intermediate_size``)
and its shared experts (``n_shared_experts * moe_intermediate_size``).

Memory: the forward and backward are one autograd Function that saves ``x``, ``a = w1 x``
and ``b = w3 x`` only; ``silu(a)`` and ``h = silu(a)·b`` (the input of ``w2``) are rebuilt in
backward (two elementwise ops) instead of being saved: two ``[T, hidden_dim]`` tensors fewer
per layer. In this plain form (CPU, fp32 and fp64, compiled code) the arithmetic is the ops
autograd would run (``F.silu``, ``aten::silu_backward``, the same matmuls), so outputs and
gradients equal the unfused module's. Under ``torch.compile``
the backward writes the product as ``b·silu(a)`` so that inductor's partitioner rebuilds it too
rather than saving the forward's (see :meth:`_SwiGLUMLP.backward`).

Gate‖up form (:func:`gate_up_kernels`: CUDA with Triton, eager, 16-bit, ``hidden_dim`` a multiple
of 8): ``h13 = x [w1; w3]ᵀ`` in one GEMM, ``silu(a)·b`` by :func:`dropless.ops.swiglu.swiglu_fwd`
(fp32 in registers, rounded once, so it differs from the unfused module in the last bf16 bit),
and in backward ``d h13`` by one :func:`~dropless.ops.swiglu.swiglu_bwd`, ``dx`` and ``d[w1; w3]``
by one GEMM each; it saves ``x`` and ``h13`` (the same bytes as ``a`` and ``b``).

Higher order: a backward run with ``create_graph=True`` (gradient penalties, double backward)
rebuilds ``a`` and ``b`` from the saved ``x`` and weights and runs the plain form's ops, so its
graph reaches the inputs and second-order gradients are those of the unfused module. Under
``torch.func`` transforms the module runs the plain modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dropless.ops import select
from dropless.ops.swiglu import swiglu_bwd, swiglu_fwd


class _SwiGLUMLP(torch.autograd.Function):
    """``w2(silu(w1 x) · w3 x)`` on ``x_TH`` [T, H]; saves ``x`` and ``a``, ``b`` (plain form) or ``h13 = [a | b]``
    (gate‖up form), besides the weights (see the module doc)."""

    @staticmethod
    def forward(ctx, x_TH, w1_FH, w3_FH, w2_HF):
        ctx.gate_up = gate_up_kernels(x_TH, w1_FH.shape[0])
        if ctx.gate_up:
            h13_T2F = F.linear(x_TH, torch.cat((w1_FH, w3_FH)))
            ctx.save_for_backward(x_TH, w1_FH, w3_FH, w2_HF, h13_T2F)
            return F.linear(swiglu_fwd(h13_T2F), w2_HF)
        a_TF = F.linear(x_TH, w1_FH)
        b_TF = F.linear(x_TH, w3_FH)
        y_TH = F.linear(F.silu(a_TF) * b_TF, w2_HF)
        ctx.save_for_backward(x_TH, w1_FH, w3_FH, w2_HF, a_TF, b_TF)
        return y_TH

    @staticmethod
    def backward(ctx, gy_TH):
        saved = ctx.saved_tensors  # read once (torch.utils.checkpoint unpacks each saved tensor once)
        x_TH, w1_FH, w3_FH, w2_HF = saved[:4]
        need = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph: a and b rebuilt from the saved inputs, so the graph reaches them
            return _plain_backward(gy_TH, x_TH, w1_FH, w3_FH, w2_HF, F.linear(x_TH, w1_FH), F.linear(x_TH, w3_FH),
                                   need)
        if ctx.gate_up:
            return _gate_up_backward(gy_TH, x_TH, w1_FH, w3_FH, w2_HF, saved[4], need)
        return _plain_backward(gy_TH, x_TH, w1_FH, w3_FH, w2_HF, *saved[4:], need)


def _plain_backward(gy_TH, x_TH, w1_FH, w3_FH, w2_HF, a_TF, b_TF, need):
    """The unfused module's backward ops, from ``a = w1 x`` and ``b = w3 x``; with grad mode on (a
    ``create_graph`` backward) SiLU's derivative is written out, so the whole pass is differentiable."""
    silu_TF = F.silu(a_TF)
    gh_TF = gy_TH @ w2_HF
    gb_TF = gh_TF * silu_TF
    if torch.is_grad_enabled():  # recording a graph: aten::silu_backward has no derivative of its own
        sig_TF = torch.sigmoid(a_TF)
        ga_TF = gh_TF * b_TF * sig_TF * (1 + a_TF * (1 - sig_TF))
    else:
        ga_TF = torch.ops.aten.silu_backward(gh_TF * b_TF, a_TF)
    dx = (ga_TF @ w1_FH + gb_TF @ w3_FH) if need[0] else None
    dw1 = ga_TF.t() @ x_TH if need[1] else None
    dw3 = gb_TF.t() @ x_TH if need[2] else None
    # ``b · silu(a)``, not the forward's ``silu(a) · b``: traced, the same op on the same nodes would
    # be the forward's product itself (the common-subexpression pass merges them), a forward value
    # that this matmul reads in backward, which inductor's min-cut partitioner then refuses to
    # recompute ("materialized in backward") and saves: one [T, hidden_dim] more per FFN than eager
    # (h200_single: ~1.1 GiB over 16 layers). As another node it is rebuilt here from the saved a, b.
    dw2 = gy_TH.t() @ (b_TF * silu_TF) if need[3] else None
    return dx, dw1, dw3, dw2


def gate_up_kernels(x_TH: torch.Tensor, hidden_dim: int) -> bool:
    """True when :class:`_SwiGLUMLP` runs its gate‖up form: ``x`` on the Triton path
    (:func:`dropless.ops.select.use_triton`), eager (inductor fuses the elementwise ops itself when
    compiling), 16-bit, and ``hidden_dim`` a multiple of 8 (the SwiGLU kernel's 16-byte vectors)."""
    return (select.use_triton(x_TH) and not torch.compiler.is_compiling() and hidden_dim % 8 == 0
            and x_TH.dtype in (torch.bfloat16, torch.float16))


def _gate_up_backward(gy_TH, x_TH, w1_FH, w3_FH, w2_HF, h13_T2F, need):
    """Backward of the gate‖up form: ``d h13`` in one SwiGLU-backward kernel, then one GEMM each for
    ``dx`` and ``d[w1; w3]``; the SwiGLU output (``w2``'s input) rebuilt by one forward kernel."""
    dh13_T2F = swiglu_bwd(h13_T2F, gy_TH @ w2_HF)
    dx = dh13_T2F @ torch.cat((w1_FH, w3_FH)) if need[0] else None
    dw13_2FH = dh13_T2F.t() @ x_TH if need[1] or need[2] else None
    dw1, dw3 = dw13_2FH.chunk(2) if dw13_2FH is not None else (None, None)
    dw2 = gy_TH.t() @ swiglu_fwd(h13_T2F) if need[3] else None
    return dx, dw1 if need[1] else None, dw3 if need[2] else None, dw2


class FeedForward(nn.Module):
    """Dense SwiGLU MLP without biases.

    Args:
        dim: model width H (``hidden_size``).
        hidden_dim: inner width (``intermediate_size`` for a dense layer,
            ``n_shared_experts * moe_intermediate_size`` for the shared experts).

    Parameters:
        w1: gate projection, ``nn.Linear(dim, hidden_dim)``, weight [hidden_dim, dim].
        w3: up projection, ``nn.Linear(dim, hidden_dim)``, weight [hidden_dim, dim].
        w2: down projection, ``nn.Linear(hidden_dim, dim)``, weight [dim, hidden_dim].

    Raises:
        ValueError: if ``dim`` or ``hidden_dim`` is not a positive integer.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        if int(dim) <= 0 or int(hidden_dim) <= 0:
            raise ValueError(
                f"FeedForward(dim={dim}, hidden_dim={hidden_dim}): both must be positive "
                "(hidden_dim comes from intermediate_size, or n_shared_experts*moe_intermediate_size)"
            )
        self.dim = int(dim)
        self.hidden_dim = int(hidden_dim)
        self.w1 = nn.Linear(self.dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.dim, self.hidden_dim, bias=False)
        self.w2 = nn.Linear(self.hidden_dim, self.dim, bias=False)

    def forward(self, x_xH: torch.Tensor) -> torch.Tensor:
        """``x_xH`` [..., H] -> [..., H], same dtype as the weights' compute."""
        w1, w3, w2 = self.w1.weight, self.w3.weight, self.w2.weight
        if (not (w1.dtype == w3.dtype == w2.dtype == x_xH.dtype) or torch.is_autocast_enabled(x_xH.device.type)
                or (not torch.compiler.is_compiling()
                    and any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in (x_xH, w1, w3, w2)))):
            # mixed dtypes, autocast, torch.func transforms (the Function has no setup_context): plain modules
            return self.w2(F.silu(self.w1(x_xH)) * self.w3(x_xH))
        return _SwiGLUMLP.apply(x_xH.reshape(-1, self.dim), w1, w3, w2).view(x_xH.shape)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}"
