"""Rotary position embedding (Su et al., "RoFormer", 2021) for MLA's rope part.

DeepSeek-V3 applies RoPE only to the ``qk_rope_head_dim`` slice of each query
head and to the single shared key ``k_pe`` (DeepSeek-V2 paper, section 2.1.3,
"decoupled RoPE"). Pairs are *interleaved*: features ``(2i, 2i+1)`` form one
complex number ``x[2i] + j*x[2i+1]`` that is rotated by the angle
``pos * theta^(-2i/d)``, ``d = qk_rope_head_dim``, ``theta = rope_theta`` —
the convention of DeepSeek-V3's inference ``model.py`` (``view_as_complex`` on
the last dim split into pairs).

YaRN (``rope_scaling`` of the published config.json; :class:`dropless.config.Yarn`):
the frequencies are interpolated as DeepSeek-V3's reference inference code does
(``precompute_freqs_cis`` in ``inference/model.py`` of deepseek-ai/DeepSeek-V3) and as the
YaRN paper defines them (Peng, Quesnelle, Fan, Shippole, "YaRN: Efficient Context Window
Extension of Large Language Models", arXiv:2309.00071, its "NTK-by-parts" interpolation with
the ramp γ between α = beta_slow and β = beta_fast rotations):
with s = ``factor``, L = ``original_max_position_embeddings``, and the dimension that turns
r times over L, ``c(r) = d·ln(L / (2π r)) / (2 ln θ)``,

    low  = max(floor(c(beta_fast)), 0),   high = min(ceil(c(beta_slow)), d − 1)
    ramp_i = clamp((i − low) / (high − low), 0, 1)      (high += 0.001 if equal)
    f'_i = f_i · (1 − ramp_i) + (f_i / s) · ramp_i,     f_i = θ^(−2i/d),  i = 0 .. d/2 − 1

so the fast-rotating pairs keep their frequency and the slow ones are interpolated by s.
The paper's attention temperature (``√(1/t) = 0.1 ln s + 1``; DeepSeek: ``0.1·m·ln s + 1``) enters as the softmax
scale × ``mscale²`` (:attr:`dropless.config.Yarn.softmax_mscale`, in
:class:`dropless.model.attention.MLA`), as in the reference's ``MLA.__init__``.

Shape letters: S sequence positions, R = ``qk_rope_head_dim``, P = R / 2 pairs.
The tables are real ``cos_SP`` / ``sin_SP`` tensors (no complex dtype), so they
work under bf16 autocast, FSDP and ``torch.compile``. They are built by device ops
from Python numbers (no host tensor copied to the device, no host sync).
"""

from __future__ import annotations

import math

import torch

from dropless.config import ConfigError, Yarn
from dropless.ops.rope_tail import rotate_tail


def yarn_correction_range(yarn: Yarn, rope_head_dim: int, rope_theta: float) -> tuple[float, float]:
    """``(low, high)`` pair indices of the interpolation ramp (see the module docstring)."""
    d, L = rope_head_dim, yarn.original_max_position_embeddings

    def turns_dim(rotations: float) -> float:
        return d * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low = max(math.floor(turns_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(turns_dim(yarn.beta_slow)), d - 1)
    return float(low), float(high) + (0.001 if low == high else 0.0)


def rope_inv_freq(rope_head_dim: int, rope_theta: float, *, yarn: Yarn | None = None, device=None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/d)``, i = 0..d/2-1 -> [P], YaRN-interpolated if ``yarn``.

    Raises:
        ValueError: ``rope_head_dim`` not positive and even, or ``rope_theta`` <= 0.
    """
    if rope_head_dim <= 0 or rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={rope_head_dim}: must be positive and even "
                         "(RoPE rotates pairs of features)")
    if rope_theta <= 0:
        raise ValueError(f"rope_theta={rope_theta}: must be > 0 (DeepSeek-V3 uses 10000)")
    exponent_P = torch.arange(0, rope_head_dim, 2, device=device, dtype=dtype) / rope_head_dim
    inv_freq_P = torch.pow(float(rope_theta), -exponent_P)  # a Python base: no host tensor copied
    if yarn is None:
        return inv_freq_P
    low, high = yarn_correction_range(yarn, rope_head_dim, rope_theta)
    ramp_P = ((torch.arange(rope_head_dim // 2, device=device, dtype=dtype) - low) / (high - low)).clamp_(0, 1)
    return inv_freq_P * (1 - ramp_P) + (inv_freq_P / yarn.factor) * ramp_P


def check_positions(seq_len: int, max_position_embeddings: int, field: str = "seq_len",
                    limit: str = "max_position_embeddings") -> None:
    """Raise ConfigError (a ValueError) when ``seq_len`` positions exceed ``max_position_embeddings``
    (the rotation tables, and YaRN's interpolation, are defined up to it); ``field`` and ``limit`` name
    the two settings in the message."""
    if seq_len > max_position_embeddings:
        raise ConfigError(f"{field}={seq_len} exceeds {limit}={max_position_embeddings}: lower {field} or raise "
                          f"{limit}")


def rope_cos_sin(seq_len: int, rope_head_dim: int, rope_theta: float, *,
                 max_position_embeddings: int | None = None, yarn: Yarn | None = None, device=None,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation tables for positions ``0..seq_len-1``.

    Args:
        seq_len: S.
        rope_head_dim: R = ``qk_rope_head_dim``.
        rope_theta: base ``rope_theta``.
        max_position_embeddings: if given, ``seq_len`` must not exceed it.
        yarn: YaRN scaling (:meth:`dropless.config.ModelArgs.yarn`), or None for plain RoPE.
        device, dtype: where and in which precision to build the angles
            (fp32 as in DeepSeek-V3; fp64 for float64 reference runs).

    Returns:
        ``(cos_SP, sin_SP)``, each [S, R/2] in ``dtype``.

    Raises:
        ValueError: ``seq_len`` < 1; ConfigError (a ValueError): ``seq_len`` > ``max_position_embeddings``
            (:func:`check_positions`).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be >= 1")
    if max_position_embeddings is not None:
        check_positions(seq_len, max_position_embeddings)
    inv_freq_P = rope_inv_freq(rope_head_dim, rope_theta, yarn=yarn, device=device, dtype=dtype)
    pos_S = torch.arange(seq_len, device=device, dtype=dtype)
    angle_SP = torch.outer(pos_S, inv_freq_P)
    return torch.cos(angle_SP), torch.sin(angle_SP)


def apply_rope(x_BSNR: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved feature pairs of ``x`` by the position angles.

    Args:
        x_BSNR: [B, S, N, R] (N heads; N = 1 for the shared key ``k_pe``).
        cos_SP, sin_SP: [S, R/2] from :func:`rope_cos_sin`.

    Returns:
        [B, S, N, R] in ``x``'s dtype; computed in ``promote_types(x.dtype, cos.dtype)``
        (at least fp32), i.e. ``(a + jb) * (cos + j sin)`` on each pair ``(a, b)``.
    """
    B, S, N, R = x_BSNR.shape
    if cos_SP.shape != (S, R // 2) or sin_SP.shape != (S, R // 2):
        raise ValueError(f"apply_rope: tables {tuple(cos_SP.shape)} do not match x "
                         f"{tuple(x_BSNR.shape)}; expected [{S}, {R // 2}]")
    compute = torch.promote_types(torch.promote_types(x_BSNR.dtype, cos_SP.dtype), torch.float32)
    x_BSNP2 = x_BSNR.to(compute).unflatten(-1, (R // 2, 2))
    a_BSNP, b_BSNP = x_BSNP2[..., 0], x_BSNP2[..., 1]
    cos_1S1P = cos_SP.to(compute)[None, :, None, :]
    sin_1S1P = sin_SP.to(compute)[None, :, None, :]
    out_BSNP2 = torch.stack(
        (a_BSNP * cos_1S1P - b_BSNP * sin_1S1P, a_BSNP * sin_1S1P + b_BSNP * cos_1S1P), dim=-1
    )
    return out_BSNP2.flatten(-2).to(x_BSNR.dtype)


class _RopeTail(torch.autograd.Function):
    """``[x[..., :D−R] | rope(x[..., D−R:])]`` as a new contiguous tensor; saves only the tables.

    ``forward`` + ``setup_context`` (not ``forward(ctx, ...)``) and ``generate_vmap_rule``, so that
    ``torch.func`` transforms (``grad``, ``vmap``, ``jacrev``) work through it; :class:`_RopeTailJvp`
    adds forward mode. (``autograd.grad(..., is_grads_batched=True)`` still fails: torch's older vmap
    has no batching rule for ``unflatten``.)"""

    generate_vmap_rule = True

    @staticmethod
    def forward(x_BSND, cos_SP, sin_SP):
        return rotate_tail(x_BSND, cos_SP, sin_SP, 1.0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, cos_SP, sin_SP = inputs
        ctx.save_for_backward(cos_SP, sin_SP)

    @staticmethod
    def backward(ctx, g_BSND):
        cos_SP, sin_SP = ctx.saved_tensors
        return rotate_tail(g_BSND, cos_SP, sin_SP, -1.0), None, None  # a rotation's transpose: −angle


class _RopeTailJvp(_RopeTail):
    """:class:`_RopeTail` with forward-mode AD (``jvp``, ``jacfwd``, ``hessian``): the map is linear in
    ``x``, so the tangent is rotated as ``x`` is. Eager only: Dynamo does not trace a Function with a
    custom ``jvp`` (compiled code takes :class:`_RopeTail`)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, cos_SP, sin_SP = inputs
        ctx.save_for_backward(cos_SP, sin_SP)
        ctx.save_for_forward(cos_SP, sin_SP)

    @staticmethod
    def jvp(ctx, gx_BSND, _g_cos, _g_sin):
        # the tables' tangents arrive materialised (zeros when they have none), so a real one cannot be
        # told apart without reading it on the host; rope_tail documents them as constants
        cos_SP, sin_SP = ctx.saved_tensors
        return rotate_tail(gx_BSND, cos_SP, sin_SP, 1.0)


def rope_tail(x_BSND: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor) -> torch.Tensor:
    """RoPE on the last R features of each head, the first D − R copied: one new tensor, no concatenation.

    Args:
        x_BSND: [B, S, N, D] (D ≥ R = 2·P; MLA's query ``[q_nope | q_pe]``, or the rope key with D = R).
        cos_SP, sin_SP: [S, P] from :func:`rope_cos_sin`.
    Returns:
        [B, S, N, D] contiguous in ``x``'s dtype: ``x[..., :D−R]`` and :func:`apply_rope` of
        ``x[..., D−R:]`` (same arithmetic, at least fp32). Backward rotates the gradient by the
        negative angle; only the tables are saved (no activation). The tables are constants: no
        gradient flows to them, and forward-mode AD (``torch.func.jvp``) ignores a tangent given
        for them (:func:`apply_rope` differentiates with respect to the angles); forward mode is not
        available inside ``torch.compile`` (Dynamo does not trace a custom ``jvp``).
    Raises:
        ValueError: ``x`` not a floating-point 4-D tensor, tables that do not match ``x``, or tables
            that require grad (no gradient flows to them: use :func:`apply_rope` to learn the angles).
    """
    if x_BSND.dim() != 4 or not x_BSND.is_floating_point():
        raise ValueError(f"rope_tail: x must be a floating-point [B, S, N, D] tensor, got {x_BSND.dtype} "
                         f"{tuple(x_BSND.shape)}")
    B, S, N, D = x_BSND.shape
    if cos_SP.shape != sin_SP.shape or cos_SP.dim() != 2 or cos_SP.shape[0] != S or 2 * cos_SP.shape[1] > D:
        raise ValueError(f"rope_tail: tables {tuple(cos_SP.shape)} do not match x {tuple(x_BSND.shape)}; expected "
                         f"[{S}, P] with 2·P <= {D}")
    if cos_SP.requires_grad or sin_SP.requires_grad:
        raise ValueError("rope_tail: cos/sin require grad, but rope_tail gives them no gradient (they are "
                         "fixed tables from rope_cos_sin); detach them, or use apply_rope to train the angles")
    return (_RopeTail if torch.compiler.is_compiling() else _RopeTailJvp).apply(x_BSND, cos_SP, sin_SP)
