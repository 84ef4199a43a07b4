"""SwiGLU ``silu(gate) * up`` over the live rows of a layout, its backward, and a fused FP8 quantisation.

Ops (each picks its Triton kernel or its torch reference in one place, :func:`dropless.ops.select.use_triton`):

* :func:`swiglu_fwd` — ``h13 [M, 2I]`` (gate = first ``I`` columns) -> ``[M, I]``.
* :func:`swiglu_bwd` — ``d(gate) || d(up)`` ``[M, 2I]`` given ``dout [M, I]`` (optionally the
  gradient of ``swiglu(h13) · row_w`` for folded routing weights ``row_w [M]``).
* :func:`swiglu_quant` — the forward's result quantised to FP8 e4m3 in the same pass: one
  fp32 scale per row per 128 columns (the 1×128 activation layout of DeepGEMM's and torch's
  blockwise FP8 GEMMs), ``scale = amax / 448`` or its power-of-two ceiling (``ue8m0``).
* :func:`swiglu` — the autograd op over :func:`swiglu_fwd` / :func:`swiglu_bwd` saving only ``h13``.

The live-row contract (DESIGN.md rule 3, seed 000 §2-3): with a layout, the Triton kernels
run on a grid of ``(P, e)`` programs; program ``(p, i)`` reads ``start[i]``/``end[i]`` on the
device and walks rows ``start[i] + p·BM, start[i] + (p + P)·BM, …`` below ``end[i]`` (a
grid-stride loop), so the work is bounded by live rows and padding rows of every output stay
unwritten; there is no schedule computed beforehand and no host sync. Without a layout
(``layout=None``) every one of the ``M`` rows is computed (the dense path). Each row is read
in 16-byte vectors (the column blocks are multiples of 8 elements; ``I`` must be a multiple
of 8 for the kernels, of 128 for the quantisation). The torch references compute every row
(padding rows give unspecified values, never read).

Arithmetic: fp32 in registers (fp64 in the torch reference for fp64 inputs), results stored
in the input's dtype; ``silu(g) = g·sigmoid(g)``, ``d silu(g)/dg = s·(1 + g·(1 − s))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dropless.layout import ExpertLayout
from dropless.ops import select
from dropless.ops.backward import first_order_only

FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANT_GROUP = 128  # columns per scale (1×128)

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _row_range(start_ptr, end_ptr, M, HAS_LAYOUT: tl.constexpr):
        """``[lo, hi)``: expert ``program_id(1)``'s live rows (clamped to ``M``), or all ``M`` rows."""
        if HAS_LAYOUT:
            ex = tl.program_id(1)
            lo = tl.load(start_ptr + ex)
            hi = tl.minimum(tl.load(end_ptr + ex), M)
        else:
            lo = M * 0
            hi = M
        return lo, hi

    @triton.jit
    def _fwd_rows(h_ptr, out_ptr, r0, hi, I, stride_h, stride_o, EVEN_N: tl.constexpr, NUM_NB: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < hi
        r64 = rows.to(tl.int64)[:, None]
        for nb in tl.static_range(NUM_NB):
            cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            if EVEN_N:
                mask = rmask[:, None]
            else:
                mask = rmask[:, None] & (cols[None, :] < I)
            hp = h_ptr + r64 * stride_h + cols[None, :]
            g = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(hp + I, mask=mask, other=0.0).to(tl.float32)
            a = g * tl.sigmoid(g) * u
            tl.store(out_ptr + r64 * stride_o + cols[None, :], a.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_fwd_kernel(h_ptr, out_ptr, start_ptr, end_ptr, M, I, stride_h, stride_o,
                           HAS_LAYOUT: tl.constexpr, EVEN_N: tl.constexpr, NUM_NB: tl.constexpr,
                           INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        lo, hi = _row_range(start_ptr, end_ptr, M, HAS_LAYOUT)
        step = tl.num_programs(0) * BLOCK_M
        r0 = lo + tl.program_id(0) * BLOCK_M
        if INTERPRET:  # the interpreter's scalars are 1-element arrays, which range() rejects
            while r0 < hi:
                _fwd_rows(h_ptr, out_ptr, r0, hi, I, stride_h, stride_o, EVEN_N, NUM_NB, BLOCK_M, BLOCK_N)
                r0 += step
        else:
            for r in range(r0, hi, step):
                _fwd_rows(h_ptr, out_ptr, r, hi, I, stride_h, stride_o, EVEN_N, NUM_NB, BLOCK_M, BLOCK_N)

    @triton.jit
    def _bwd_rows(h_ptr, do_ptr, w_ptr, dh_ptr, r0, hi, I, stride_h, stride_do, stride_dh, HAS_W: tl.constexpr,
                  EVEN_N: tl.constexpr, NUM_NB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < hi
        r64 = rows.to(tl.int64)[:, None]
        if HAS_W:  # folded routing weight: d(out) = d(out · w) · w, w as the forward rounded it
            w = tl.load(w_ptr + rows, mask=rmask, other=0.0).to(h_ptr.dtype.element_ty).to(tl.float32)
        for nb in tl.static_range(NUM_NB):
            cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            if EVEN_N:
                mask = rmask[:, None]
            else:
                mask = rmask[:, None] & (cols[None, :] < I)
            hp = h_ptr + r64 * stride_h + cols[None, :]
            g = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(hp + I, mask=mask, other=0.0).to(tl.float32)
            do = tl.load(do_ptr + r64 * stride_do + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                do = do * w[:, None]
            s = tl.sigmoid(g)
            dg = do * u * s * (1.0 + g * (1.0 - s))
            du = do * g * s
            dp = dh_ptr + r64 * stride_dh + cols[None, :]
            tl.store(dp, dg.to(dh_ptr.dtype.element_ty), mask=mask)
            tl.store(dp + I, du.to(dh_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(h_ptr, do_ptr, w_ptr, dh_ptr, start_ptr, end_ptr, M, I, stride_h, stride_do,
                           stride_dh, HAS_LAYOUT: tl.constexpr, HAS_W: tl.constexpr, EVEN_N: tl.constexpr,
                           NUM_NB: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
        lo, hi = _row_range(start_ptr, end_ptr, M, HAS_LAYOUT)
        step = tl.num_programs(0) * BLOCK_M
        r0 = lo + tl.program_id(0) * BLOCK_M
        if INTERPRET:
            while r0 < hi:
                _bwd_rows(h_ptr, do_ptr, w_ptr, dh_ptr, r0, hi, I, stride_h, stride_do, stride_dh, HAS_W, EVEN_N,
                          NUM_NB, BLOCK_M, BLOCK_N)
                r0 += step
        else:
            for r in range(r0, hi, step):
                _bwd_rows(h_ptr, do_ptr, w_ptr, dh_ptr, r, hi, I, stride_h, stride_do, stride_dh, HAS_W, EVEN_N,
                          NUM_NB, BLOCK_M, BLOCK_N)

    @triton.jit
    def _quant_rows(h_ptr, q_ptr, s_ptr, r0, hi, I, stride_h, stride_q, stride_s, UE8M0: tl.constexpr,
                    NUM_G: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < hi
        r64 = rows.to(tl.int64)[:, None]
        for gi in tl.static_range(NUM_G):
            cols = gi * GROUP + tl.arange(0, GROUP)
            mask = rmask[:, None]
            hp = h_ptr + r64 * stride_h + cols[None, :]
            g = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(hp + I, mask=mask, other=0.0).to(tl.float32)
            a = g * tl.sigmoid(g) * u
            amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-10)
            scale = amax / 448.0
            if UE8M0:
                scale = tl.exp2(tl.ceil(tl.log2(scale)))
            q = tl.clamp(a / scale[:, None], -448.0, 448.0)
            tl.store(q_ptr + r64 * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
            tl.store(s_ptr + gi * stride_s + rows, scale, mask=rmask)

    @triton.jit
    def _swiglu_quant_kernel(h_ptr, q_ptr, s_ptr, start_ptr, end_ptr, M, I, stride_h, stride_q, stride_s,
                             HAS_LAYOUT: tl.constexpr, UE8M0: tl.constexpr, NUM_G: tl.constexpr,
                             INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
        lo, hi = _row_range(start_ptr, end_ptr, M, HAS_LAYOUT)
        step = tl.num_programs(0) * BLOCK_M
        r0 = lo + tl.program_id(0) * BLOCK_M
        if INTERPRET:
            while r0 < hi:
                _quant_rows(h_ptr, q_ptr, s_ptr, r0, hi, I, stride_h, stride_q, stride_s, UE8M0, NUM_G, BLOCK_M,
                            GROUP)
                r0 += step
        else:
            for r in range(r0, hi, step):
                _quant_rows(h_ptr, q_ptr, s_ptr, r, hi, I, stride_h, stride_q, stride_s, UE8M0, NUM_G, BLOCK_M,
                            GROUP)

# Launch shape: BLOCK_M rows × BLOCK_N columns per step (4 warps: 8 bf16 = 16 bytes per thread
# per load at BLOCK_N = 1024), and P programs per expert.
BLOCK_M, BLOCK_N, NUM_WARPS = 4, 1024, 4
QUANT_BLOCK_M = 16
PROGRAMS_PER_SM = 4  # resident programs per SM the grid aims at


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def programs_per_expert(layout: ExpertLayout, device: torch.device, block_m: int,
                        per_sm: int = PROGRAMS_PER_SM) -> int:
    """``P``: programs per local expert in the ``(P, e)`` grid.

    ``P·e`` is about ``per_sm`` programs per SM, but ``P`` is at least ``per_sm·SMs/8`` so
    that a skewed layout (one expert holding every row) still spreads over an eighth of the
    GPU; never more than the buffer's row blocks.
    """
    sms = _num_sms(device)
    blocks = max(1, -(-layout.capacity // block_m))
    e = max(1, layout.num_experts)
    return max(1, min(blocks, max(-(-sms * per_sm // e), -(-sms * per_sm // 8))))


def _check(name: str, h13_MI2: torch.Tensor, layout: ExpertLayout | None, kernel: bool) -> int:
    """Host-side checks from shapes, before any launch; returns ``I``."""
    if h13_MI2.dim() != 2 or h13_MI2.shape[1] % 2:
        raise ValueError(f"{name}: h13 must be [M, 2I] (gate || up), got {tuple(h13_MI2.shape)}")
    if layout is not None and h13_MI2.shape[0] != layout.capacity:
        raise ValueError(f"{name}: h13 has {h13_MI2.shape[0]} rows but the layout's capacity M is "
                         f"{layout.capacity}; pass the whole landed buffer")
    i = h13_MI2.shape[1] // 2
    if kernel:
        if h13_MI2.stride(1) != 1:
            raise ValueError(f"{name}: h13's columns must be contiguous (stride(1) == 1), got strides "
                             f"{h13_MI2.stride()}; call .contiguous() first")
        if i % 8:
            raise ValueError(f"{name}: the Triton kernel reads 16-byte vectors and needs I "
                             f"(moe_intermediate_size) to be a multiple of 8, got {i}")
    return i


def _check_same(name: str, what: str, t: torch.Tensor, shape: tuple, kernel: bool) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: {what} must be {list(shape)}, got {list(t.shape)}")
    if kernel and t.dim() == 2 and t.stride(1) != 1:
        raise ValueError(f"{name}: {what}'s columns must be contiguous, got strides {t.stride()}")


def _launch_args(layout: ExpertLayout | None, h13: torch.Tensor, i: int, block_m: int, block_n: int,
                 programs: int | None):
    """``(start, end, BLOCK_N, grid)``: the ``(P, e)`` grid with a layout, one program per row block without."""
    bn = min(block_n, triton.next_power_of_2(i))
    if layout is None:
        p = programs or -(-h13.shape[0] // block_m)
        return h13, h13, bn, (p, 1)
    p = programs or programs_per_expert(layout, h13.device, block_m)
    return layout.start, layout.end, bn, (p, max(1, layout.num_experts))


# ---------------------------------------------------------------------------- torch references
def swiglu_fwd_torch(h13_MI2: torch.Tensor) -> torch.Tensor:
    """Reference: ``silu(gate) * up`` over every row, in ``h13``'s dtype (torch's own rounding)."""
    gate, up = h13_MI2.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_bwd_torch(h13_MI2: torch.Tensor, dout_MI: torch.Tensor, row_w_M: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Reference of :func:`swiglu_bwd` over every row, in fp32 (fp64 for fp64 inputs)."""
    acc = torch.promote_types(h13_MI2.dtype, torch.float32)
    gate, up = h13_MI2.to(acc).chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    dh = dout_MI.to(acc)
    if row_w_M is not None:
        dh = dh * row_w_M.to(h13_MI2.dtype).to(acc).unsqueeze(1)
    return torch.cat([dh * up * s * (1 + gate * (1 - s)), dh * gate * s], dim=-1).to(h13_MI2.dtype)


def quant_fp8_torch(a_MI: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference 1×128 e4m3 quantisation of ``a_MI`` (any float dtype; computed in fp32).

    Returns ``(q [M, I] float8_e4m3fn, scale [M, I/128] fp32)`` with
    ``a ≈ q · scale`` per 128-column group; ``scale = max(amax, 1e-10) / 448``, rounded up to
    a power of two with ``ue8m0``.
    """
    m, i = a_MI.shape
    a = a_MI.float().view(m, i // QUANT_GROUP, QUANT_GROUP)
    scale = a.abs().amax(-1).clamp_min(1e-10) / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (a / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, i), scale


# ---------------------------------------------------------------------------- the ops
def swiglu_fwd(h13_MI2: torch.Tensor, layout: ExpertLayout | None = None, *, out: torch.Tensor | None = None,
               programs: int | None = None) -> torch.Tensor:
    """``silu(gate) * up``: ``h13 [M, 2I]`` -> ``[M, I]`` in ``h13``'s dtype, without autograd.

    Args:
        h13_MI2: FC1's output, gate in the first ``I`` columns; columns contiguous.
        layout: its :class:`ExpertLayout` (``M`` = capacity): the Triton kernel computes live
            rows only and leaves padding rows unwritten. None: every row (dense).
        out: ``[M, I]`` buffer to write into (its padding rows are left as they are on the
            Triton path); default a fresh one.
        programs: override ``P``, the programs per expert (default :func:`programs_per_expert`;
            without a layout, the number of programs of the grid-stride loop).
    Raises:
        ValueError: ``h13`` not ``[M, 2I]``, ``M`` not the layout's capacity, columns not
            contiguous or ``I`` not a multiple of 8 (Triton path).
    """
    kernel = select.use_triton(h13_MI2)
    i = _check("swiglu_fwd", h13_MI2, layout, kernel)
    m = h13_MI2.shape[0]
    if out is not None:
        _check_same("swiglu_fwd", "out", out, (m, i), True)
    if not kernel:
        return swiglu_fwd_torch(h13_MI2) if out is None else out.copy_(swiglu_fwd_torch(h13_MI2))
    out = h13_MI2.new_empty(m, i) if out is None else out
    if m == 0 or i == 0:
        return out
    start, end, bn, grid = _launch_args(layout, h13_MI2, i, BLOCK_M, BLOCK_N, programs)
    _swiglu_fwd_kernel[grid](h13_MI2, out, start, end, m, i, h13_MI2.stride(0), out.stride(0),
                             HAS_LAYOUT=layout is not None, EVEN_N=i % bn == 0, NUM_NB=-(-i // bn),
                             INTERPRET=select.interpreting(), BLOCK_M=BLOCK_M, BLOCK_N=bn, num_warps=NUM_WARPS)
    return out


def swiglu_bwd(h13_MI2: torch.Tensor, dout_MI: torch.Tensor, layout: ExpertLayout | None = None,
               row_w_M: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
               programs: int | None = None) -> torch.Tensor:
    """Gradient ``[M, 2I]`` (d gate || d up) of :func:`swiglu_fwd`, in ``h13``'s dtype.

    With ``row_w_M`` (``[M]``, the folded routing weights) it is the gradient of
    ``swiglu_fwd(h13) · row_w`` given ``dout`` = d(that product): the weight (rounded to
    ``h13``'s dtype, as the forward multiplied it) scales ``dout`` in fp32 registers, so no
    scaled ``[M, I]`` copy of ``dout`` is made. With a layout, padding rows of the result
    (``out`` if given, ``[M, 2I]``) are left unwritten (Triton path). Raises ValueError as :func:`swiglu_fwd`, and on a ``dout``
    that is not ``[M, I]`` or a ``row_w`` that is not ``[M]``.
    """
    kernel = select.use_triton(h13_MI2)
    i = _check("swiglu_bwd", h13_MI2, layout, kernel)
    m = h13_MI2.shape[0]
    _check_same("swiglu_bwd", "dout", dout_MI, (m, i), kernel)
    if row_w_M is not None:
        _check_same("swiglu_bwd", "row_w", row_w_M, (m,), kernel)
    if out is not None:
        _check_same("swiglu_bwd", "out", out, (m, 2 * i), True)
    if not kernel:
        ref = swiglu_bwd_torch(h13_MI2, dout_MI, row_w_M)
        return ref if out is None else out.copy_(ref)
    dh = h13_MI2.new_empty(m, 2 * i) if out is None else out
    if m == 0 or i == 0:
        return dh
    start, end, bn, grid = _launch_args(layout, h13_MI2, i, BLOCK_M, BLOCK_N, programs)
    w = row_w_M.contiguous() if row_w_M is not None else dout_MI
    _swiglu_bwd_kernel[grid](h13_MI2, dout_MI, w, dh, start, end, m, i, h13_MI2.stride(0), dout_MI.stride(0),
                             dh.stride(0), HAS_LAYOUT=layout is not None, HAS_W=row_w_M is not None,
                             EVEN_N=i % bn == 0, NUM_NB=-(-i // bn), INTERPRET=select.interpreting(),
                             BLOCK_M=BLOCK_M, BLOCK_N=bn, num_warps=NUM_WARPS)
    return dh


def swiglu_quant(h13_MI2: torch.Tensor, layout: ExpertLayout | None = None, ue8m0: bool = False, *,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None, programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(gate) * up`` quantised to FP8 e4m3 with 1×128 scales, in one pass over ``h13``.

    Args:
        h13_MI2: ``[M, 2I]`` FC1 output (bf16/fp16/fp32), ``I`` a multiple of 128.
        layout: with it, live rows only (padding rows of ``q`` and of ``scale`` unwritten).
        ue8m0: power-of-two scales (``2^ceil(log2(amax / 448))``, UE8M0-representable).
        out: ``(q, scale)`` to write into, shaped and strided as the result (padding rows
            left as they are on the Triton path); default fresh ones.
    Returns:
        ``q [M, I]`` ``torch.float8_e4m3fn`` and ``scale [M, I/128]`` fp32 with
        ``swiglu ≈ q · scale`` per 128-column group of each row. ``scale`` is a view of an
        ``[I/128, M']`` buffer (``M'`` = ``M`` rounded up to 4): strides ``(1, M')``, the
        MN-major layout the blockwise FP8 GEMMs read. The SwiGLU is computed in fp32 and
        quantised from fp32 (never rounded to bf16 first); ``scale = max(amax, 1e-10)/448``.
    Raises:
        ValueError: as :func:`swiglu_fwd`, or ``I`` not a multiple of 128 (the 1×128 groups).
    """
    kernel = select.use_triton(h13_MI2)
    i = _check("swiglu_quant", h13_MI2, layout, kernel)
    if i % QUANT_GROUP:
        raise ValueError(f"swiglu_quant: the 1x128 FP8 layout needs I (moe_intermediate_size) to be a "
                         f"multiple of {QUANT_GROUP}, got {i}")
    m, g = h13_MI2.shape[0], i // QUANT_GROUP
    if out is None:
        scale = torch.empty(g, -(-m // 4) * 4, dtype=torch.float32, device=h13_MI2.device).t()[:m]
        q = torch.empty(m, i, dtype=torch.float8_e4m3fn, device=h13_MI2.device)
    else:
        q, scale = out
        if (tuple(q.shape) != (m, i) or q.dtype != torch.float8_e4m3fn or q.stride(1) != 1
                or tuple(scale.shape) != (m, g) or scale.dtype != torch.float32 or scale.stride(0) != 1):
            raise ValueError(f"swiglu_quant: out must be (q [{m}, {i}] float8_e4m3fn, row-contiguous; scale "
                             f"[{m}, {g}] float32 with stride(0) == 1), got {tuple(q.shape)} {q.dtype} and "
                             f"{tuple(scale.shape)} {scale.dtype} strides {scale.stride()}")
    if not kernel:
        qr, sr = quant_fp8_torch(swiglu_fwd_torch(h13_MI2.float()), ue8m0)
        return q.copy_(qr), scale.copy_(sr)
    if m == 0 or i == 0:
        return q, scale
    start, end, _, grid = _launch_args(layout, h13_MI2, i, QUANT_BLOCK_M, QUANT_GROUP, programs)
    _swiglu_quant_kernel[grid](h13_MI2, q, scale, start, end, m, i, h13_MI2.stride(0), q.stride(0),
                               scale.stride(1), HAS_LAYOUT=layout is not None, UE8M0=ue8m0,
                               NUM_G=i // QUANT_GROUP, INTERPRET=select.interpreting(), BLOCK_M=QUANT_BLOCK_M,
                               GROUP=QUANT_GROUP, num_warps=NUM_WARPS)
    return q, scale


class _SwiGLU(torch.autograd.Function):
    """SwiGLU that saves only its input ``h13`` (not ``silu(gate)`` as autograd of the torch ops would)."""

    @staticmethod
    def forward(ctx, h13_MI2, layout):
        ctx.layout = layout
        ctx.save_for_backward(h13_MI2)
        return swiglu_fwd(h13_MI2, layout)

    @staticmethod
    @first_order_only
    def backward(ctx, dout_MI):
        (h13_MI2,) = ctx.saved_tensors
        return swiglu_bwd(h13_MI2, dout_MI.contiguous(), ctx.layout), None


def swiglu(h13_MI2: torch.Tensor, layout: ExpertLayout | None = None) -> torch.Tensor:
    """``silu(gate) * up`` on ``[M, 2I]`` (gate = first ``I`` columns) -> ``[M, I]``, same dtype, with autograd.

    Saves only ``h13`` for backward. With a ``layout`` on the Triton path only live rows are
    computed (DESIGN.md rule 3) and padding rows of the result and of its gradient stay
    unwritten; elsewhere every row is computed (padding rows give garbage, never read).
    Without a ``layout`` it is the plain torch expression (any rows, autograd of the torch ops).
    """
    if layout is None:
        return swiglu_fwd_torch(h13_MI2)
    return _SwiGLU.apply(h13_MI2, layout)
