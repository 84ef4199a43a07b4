"""SwiGLU ``silu(gate) * up`` over the live rows of a layout, its backward, and a fused FP8 quantisation.

Ops (each picks its Triton kernel or its torch reference in one place, :func:`dropless.ops.select.use_triton`):

* :func:`swiglu_fwd` — ``h13 [M, 2I]`` (gate = first ``I`` columns) -> ``[M, I]``, optionally times
  folded routing weights ``row_w [M]`` in the same pass.
* :func:`swiglu_bwd` — ``d(gate) || d(up)`` ``[M, 2I]`` given ``dout [M, I]`` (optionally the
  gradient of ``swiglu(h13) · row_w``, and ``d row_w`` in the same pass).
* :func:`swiglu_quant` — the forward's result quantised to FP8 e4m3 in the same pass: one
  fp32 scale per row per 128 columns (the 1×128 activation layout of DeepGEMM's and torch's
  blockwise FP8 GEMMs), ``scale = amax / 448`` or its power-of-two ceiling (``ue8m0``).
* :func:`swiglu` — the autograd op over :func:`swiglu_fwd` / :func:`swiglu_bwd` saving only ``h13``.

The live-row contract (docs/design.md#the-live-row-contract, rule 3): with a layout, each program of the
Triton kernel reads ``start``/``end`` on the device and walks live row blocks only in a
grid-stride loop (:class:`LaunchConfig` says how the blocks are dealt out), so the work is
bounded by live rows and padding rows of every output stay unwritten; there is no schedule
computed by other kernels beforehand and no host sync. Without a layout
(``layout=None``) every one of the ``M`` rows is computed (the dense path). Each row is read
in 16-byte vectors (the column blocks are multiples of 8 elements; ``I`` must be a multiple
of 8 for the kernels, of 128 for the quantisation). The torch references compute every row
(padding rows give unspecified values, never read).

Arithmetic: fp32 in registers (fp64 in the torch reference for fp64 inputs), results stored
in the input's dtype; ``silu(g) = g·sigmoid(g)``, ``d silu(g)/dg = s·(1 + g·(1 − s))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dropless.layout import ExpertLayout
from dropless.ops import select
from dropless.ops.backward import first_order_only
from dropless.ops.ue8m0 import FP8_MAX, amax_scale, pow2_ceil

QUANT_GROUP = 128  # columns per scale (1×128)

OP_FWD, OP_BWD, OP_QUANT = 0, 1, 2

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    from dropless.ops.flat_tiles import flat_unit as _flat_unit
    from dropless.ops.flat_tiles import live_tiles as _live_tiles
    from dropless.ops.ue8m0 import pow2_ceil_bits

    @triton.jit
    def _tile(h_ptr, do_ptr, w_ptr, out_ptr, s_ptr, dw_ptr, r0, hi, c0, I, stride_h, stride_do, stride_o, stride_s,
              OP: tl.constexpr, HAS_W: tl.constexpr, DW: tl.constexpr, UE8M0: tl.constexpr, EVEN_N: tl.constexpr,
              NUM_NB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
        """The tile of rows ``[r0, min(r0 + BLOCK_M, hi))`` and columns ``[c0, c0 + BLOCK_N)`` (below ``I``)."""
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < hi
        r64 = rows.to(tl.int64)[:, None]
        cols = c0 + tl.arange(0, BLOCK_N)
        if EVEN_N:
            mask = rmask[:, None]
        else:
            mask = rmask[:, None] & (cols[None, :] < I)
        hp = h_ptr + r64 * stride_h + cols[None, :]
        g = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(hp + I, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        if OP == 0:
            y = g * s * u
            if HAS_W:  # folded routing weight, rounded to the input's dtype as the backward reads it
                w = tl.load(w_ptr + rows, mask=rmask, other=0.0).to(h_ptr.dtype.element_ty).to(tl.float32)
                y = y * w[:, None]
            tl.store(out_ptr + r64 * stride_o + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
        elif OP == 1:
            do = tl.load(do_ptr + r64 * stride_do + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if DW:  # d(row weight): this column block's part of sum_j d(out)_j · swiglu_j, fp32
                tl.store(dw_ptr + rows * NUM_NB + c0 // BLOCK_N, tl.sum(do * g * s * u, axis=1), mask=rmask)
            if HAS_W:  # folded routing weight: d(out) = d(out · w) · w, w as the forward rounded it
                w = tl.load(w_ptr + rows, mask=rmask, other=0.0).to(h_ptr.dtype.element_ty).to(tl.float32)
                do = do * w[:, None]
            op = out_ptr + r64 * stride_o + cols[None, :]
            tl.store(op, (do * u * s * (1.0 + g * (1.0 - s))).to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(op + I, (do * g * s).to(out_ptr.dtype.element_ty), mask=mask)
        else:  # 1x128 e4m3: one scale per row per GROUP columns
            a = tl.reshape(g * s * u, (BLOCK_M, BLOCK_N // GROUP, GROUP))
            amax = tl.maximum(tl.max(tl.abs(a), axis=2), 1e-10)
            scale = tl.math.div_rn(amax, 448.0)
            if UE8M0:
                scale = pow2_ceil_bits(scale)
            q = tl.reshape(tl.clamp(tl.math.div_rn(a, scale[:, :, None]), -448.0, 448.0), (BLOCK_M, BLOCK_N))
            tl.store(out_ptr + r64 * stride_o + cols[None, :],
                     q.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
            grp = c0 // GROUP + tl.arange(0, BLOCK_N // GROUP)
            tl.store(s_ptr + grp[None, :] * stride_s + rows[:, None], scale,
                     mask=rmask[:, None] & (grp[None, :] * GROUP < I))

    @triton.jit
    def _swiglu_kernel(h_ptr, do_ptr, w_ptr, out_ptr, s_ptr, dw_ptr, start_ptr, end_ptr, M, E, I, stride_h,
                       stride_do, stride_o, stride_s, OP: tl.constexpr, SCHED: tl.constexpr, HAS_W: tl.constexpr,
                       DW: tl.constexpr, UE8M0: tl.constexpr, EVEN_N: tl.constexpr, NUM_NB: tl.constexpr,
                       EP: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       GROUP: tl.constexpr):
        # tiles: BLOCK_M rows x BLOCK_N columns; an expert's tile t covers rows start + (t // NUM_NB)·BLOCK_M
        # and columns (t % NUM_NB)·BLOCK_N
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        if SCHED == 0:  # dense: one program per tile of the whole buffer, no loop
            _tile(h_ptr, do_ptr, w_ptr, out_ptr, s_ptr, dw_ptr, (pid // NUM_NB) * BLOCK_M, M,
                  (pid % NUM_NB) * BLOCK_N, I, stride_h, stride_do, stride_o, stride_s, OP, HAS_W, DW, UE8M0, EVEN_N,
                  NUM_NB, BLOCK_M, BLOCK_N, GROUP)
        elif SCHED == 1:
            # flat: every program reads the e end points and numbers the live tiles itself (cumsum in
            # registers): tiles of expert i are cum[i] - nt[i] … cum[i] - 1; program p takes p, p + G, …
            ar, nb_v, cum_v, start_v, end_v, total = _live_tiles(start_ptr, end_ptr, M, E, EP, NUM_NB, BLOCK_M)
            if INTERPRET:  # the interpreter's scalars are 1-element arrays, which range() rejects
                b = pid
                while b < total:
                    r0, hi, c0 = _flat_unit(b, ar, nb_v, cum_v, start_v, end_v, NUM_NB, BLOCK_M, BLOCK_N)
                    _tile(h_ptr, do_ptr, w_ptr, out_ptr, s_ptr, dw_ptr, r0, hi, c0, I, stride_h, stride_do, stride_o,
                          stride_s, OP, HAS_W, DW, UE8M0, EVEN_N, NUM_NB, BLOCK_M, BLOCK_N, GROUP)
                    b += nprog
            else:
                for b in range(pid, total, nprog):
                    r0, hi, c0 = _flat_unit(b, ar, nb_v, cum_v, start_v, end_v, NUM_NB, BLOCK_M, BLOCK_N)
                    _tile(h_ptr, do_ptr, w_ptr, out_ptr, s_ptr, dw_ptr, r0, hi, c0, I, stride_h, stride_do, stride_o,
                          stride_s, OP, HAS_W, DW, UE8M0, EVEN_N, NUM_NB, BLOCK_M, BLOCK_N, GROUP)
        else:
            # expert: program (p, i) takes expert i's tiles p, p + P, … (program_id(1) picks the expert)
            ex = tl.program_id(1)
            lo = tl.load(start_ptr + ex)
            hi = tl.minimum(tl.load(end_ptr + ex), M)
            n = (tl.maximum(hi - lo, 0) + BLOCK_M - 1) // BLOCK_M * NUM_NB
            if INTERPRET:
                t = pid + lo * 0
                while t < n:
                    _tile(h_ptr, do_ptr, w_ptr, out_ptr, s_ptr, dw_ptr, lo + (t // NUM_NB) * BLOCK_M, hi,
                          (t % NUM_NB) * BLOCK_N, I, stride_h, stride_do, stride_o, stride_s, OP, HAS_W, DW, UE8M0,
                          EVEN_N, NUM_NB, BLOCK_M, BLOCK_N, GROUP)
                    t += nprog
            else:
                for t in range(pid, n, nprog):
                    _tile(h_ptr, do_ptr, w_ptr, out_ptr, s_ptr, dw_ptr, lo + (t // NUM_NB) * BLOCK_M, hi,
                          (t % NUM_NB) * BLOCK_N, I, stride_h, stride_do, stride_o, stride_s, OP, HAS_W, DW, UE8M0,
                          EVEN_N, NUM_NB, BLOCK_M, BLOCK_N, GROUP)


SCHEDULES = {"dense": 0, "flat": 1, "expert": 2}


@dataclass(frozen=True)
class LaunchConfig:
    """How the SwiGLU kernels are launched (the defaults are the measured best on an H200).

    The work is cut into tiles of ``block_m`` rows × ``block_n`` columns.

    Attributes:
        schedule: how the tiles of the live rows are dealt out when a layout is given (without
            one, every program takes one tile of the whole buffer). ``"flat"``: a 1-D grid of
            ``G`` programs; each reads the ``e`` end points, numbers the live tiles of all
            experts itself (``cumsum`` in registers) and takes tiles ``p, p + G, …``, so any
            split of the rows over the experts (one expert holding every row included) spreads
            over the whole GPU. ``"expert"``: a ``(P, e)`` grid; program ``(p, i)`` takes expert
            ``i``'s tiles ``p, p + P, …`` (``program_id(1)`` picks the expert).
        block_m: rows per tile. block_n: columns per tile (a power of two; a multiple of 128
            for the quantisation). num_warps: warps per program.
        programs_per_sm: ``G`` (flat) or ``P·e`` (expert) is about this many programs per SM.
    """

    schedule: str = "flat"
    block_m: int = 4
    block_n: int = 1024
    num_warps: int = 4
    programs_per_sm: int = 32


#: Per op, the configs measured best on an H200 (benchmarks/live_rows.py --sweep): the full
#: buffer's time first (what training sees), then 3,072 live of 28,672 rows, one expert holding
#: every row not slower (benchmarks/results/live_rows.jsonl).
DEFAULT_CONFIGS = {OP_FWD: LaunchConfig(programs_per_sm=64), OP_BWD: LaunchConfig(programs_per_sm=64),
                   OP_QUANT: LaunchConfig()}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _grid(num_experts: int | None, m: int, nnb: int, cfg: LaunchConfig, device: torch.device) -> tuple[int, int]:
    """The launch grid for ``num_experts`` local experts (None: the dense path) over ``m`` rows of ``nnb``
    column blocks."""
    sms = _num_sms(device)
    tiles = max(1, -(-m // cfg.block_m)) * nnb
    if num_experts is None:  # dense: one program per tile
        return tiles, 1
    if cfg.schedule == "flat":
        return max(1, min(tiles + num_experts * nnb, sms * cfg.programs_per_sm)), 1
    e = max(1, num_experts)
    # P: about programs_per_sm per SM in all, but at least an eighth of the GPU for one expert
    p = max(-(-sms * cfg.programs_per_sm // e), -(-sms * cfg.programs_per_sm // 8))
    return max(1, min(tiles, p)), e


def _block_n(i: int, op: int, cfg: LaunchConfig) -> int:
    """Columns per tile for ``I = i``: ``cfg.block_n``, or less for a narrow ``I`` (at least 128 to quantise)."""
    nb = 1 << max(0, i - 1).bit_length()  # next power of two
    return min(cfg.block_n, max(nb, QUANT_GROUP if op == OP_QUANT else 1))


def _launch(op: int, h13: torch.Tensor, layout: ExpertLayout | None, out: torch.Tensor, *, dout=None, row_w=None,
            scale=None, dw=None, ue8m0: bool = False, config: LaunchConfig | None = None) -> None:
    cfg = config or DEFAULT_CONFIGS[op]
    if cfg.schedule not in ("flat", "expert"):
        raise ValueError(f"LaunchConfig.schedule must be 'flat' or 'expert', got {cfg.schedule!r}")
    start, end = (layout.start, layout.end) if layout is not None else (None, None)
    # the opaque op only while torch.compile traces; eager calls skip its dispatch (tens of µs a call)
    launch = _swiglu_op if torch.compiler.is_compiling() else _swiglu_launch
    launch(op, h13, start, end, out, dout, row_w, scale, dw, ue8m0, cfg.schedule, cfg.block_m, cfg.block_n,
           cfg.num_warps, cfg.programs_per_sm)


def _swiglu_launch(op: int, h13: torch.Tensor, start: torch.Tensor | None, end: torch.Tensor | None, out: torch.Tensor,
                   dout: torch.Tensor | None, row_w: torch.Tensor | None, scale: torch.Tensor | None,
                   dw: torch.Tensor | None, ue8m0: bool, schedule: str, block_m: int, block_n: int, num_warps: int,
                   programs_per_sm: int) -> None:
    """The Triton launch; as ``dropless::swiglu`` an opaque op with a fake (no-op) implementation, so
    that ``torch.compile`` traces the layer around it (``fullgraph=True``) and calls the kernel as it is."""
    cfg = LaunchConfig(schedule, block_m, block_n, num_warps, programs_per_sm)
    m, i = h13.shape[0], h13.shape[1] // 2
    bn = _block_n(i, op, cfg)
    nnb = -(-i // bn)
    has_layout = start is not None
    e = start.numel() if has_layout else 1
    sv, ev = (start, end) if has_layout else (h13, h13)
    do = dout if dout is not None else h13
    w = row_w if row_w is not None else h13
    s = scale if scale is not None else h13
    _swiglu_kernel[_grid(e if has_layout else None, m, nnb, cfg, h13.device)](
        h13, do, w, out, s, dw if dw is not None else h13, sv, ev, m, e, i, h13.stride(0), do.stride(0),
        out.stride(0), scale.stride(1) if scale is not None else 0, OP=op,
        SCHED=SCHEDULES[schedule] if has_layout else 0, HAS_W=row_w is not None, DW=dw is not None, UE8M0=ue8m0,
        EVEN_N=i % bn == 0, NUM_NB=nnb, EP=triton.next_power_of_2(max(e, 2)),
        INTERPRET=select.interpreting(), BLOCK_M=block_m, BLOCK_N=bn, GROUP=QUANT_GROUP, num_warps=num_warps)


_swiglu_op = torch.library.custom_op("dropless::swiglu", _swiglu_launch, mutates_args=("out", "scale", "dw"))


@_swiglu_op.register_fake
def _(op, h13, start, end, out, dout, row_w, scale, dw, ue8m0, schedule, block_m, block_n, num_warps,
      programs_per_sm):
    return None


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


# ---------------------------------------------------------------------------- torch references
def swiglu_fwd_torch(h13_MI2: torch.Tensor, row_w_M: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: ``silu(gate) * up`` over every row, in ``h13``'s dtype (torch's own rounding), times
    ``row_w`` (rounded to that dtype) per row if given."""
    gate, up = h13_MI2.chunk(2, dim=-1)
    a = F.silu(gate) * up
    return a if row_w_M is None else a * row_w_M.to(a.dtype).unsqueeze(1)


def swiglu_bwd_torch(h13_MI2: torch.Tensor, dout_MI: torch.Tensor, row_w_M: torch.Tensor | None = None,
                     row_w_grad: bool = False):
    """Reference of :func:`swiglu_bwd` over every row, in fp32 (fp64 for fp64 inputs); with ``row_w_grad``
    the pair ``(d h13, d row_w)`` as :func:`swiglu_bwd` returns it."""
    acc = torch.promote_types(h13_MI2.dtype, torch.float32)
    gate, up = h13_MI2.to(acc).chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    dh = dout_MI.to(acc)
    d_row_w = (dh * gate * s * up).sum(-1) if row_w_grad else None
    if row_w_M is not None:
        dh = dh * row_w_M.to(h13_MI2.dtype).to(acc).unsqueeze(1)
    dh13 = torch.cat([dh * up * s * (1 + gate * (1 - s)), dh * gate * s], dim=-1).to(h13_MI2.dtype)
    return (dh13, d_row_w) if row_w_grad else dh13


def quant_fp8_torch(a_MI: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference 1×128 e4m3 quantisation of ``a_MI`` (any float dtype; computed in fp32).

    Returns ``(q [M, I] float8_e4m3fn, scale [M, I/128] fp32)`` with
    ``a ≈ q · scale`` per 128-column group; ``scale = max(amax, 1e-10) / 448``, rounded up to
    a power of two with ``ue8m0``.
    """
    m, i = a_MI.shape
    a = a_MI.float().view(m, i // QUANT_GROUP, QUANT_GROUP)
    scale = amax_scale(a.abs().amax(-1), 1e-10)
    if ue8m0:
        scale = pow2_ceil(scale)
    q = (a / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, i), scale


# ---------------------------------------------------------------------------- the ops
def swiglu_fwd(h13_MI2: torch.Tensor, layout: ExpertLayout | None = None, *, row_w: torch.Tensor | None = None,
               out: torch.Tensor | None = None, config: LaunchConfig | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (× ``row_w`` per row): ``h13 [M, 2I]`` -> ``[M, I]`` in ``h13``'s dtype, without autograd.

    Args:
        h13_MI2: FC1's output, gate in the first ``I`` columns; columns contiguous.
        layout: its :class:`ExpertLayout` (``M`` = capacity): the Triton kernel computes live
            rows only and leaves padding rows unwritten. None: every row (dense).
        row_w: ``[M]`` folded routing weights (``fold_routing_weights``), rounded to ``h13``'s
            dtype and multiplied in before the single rounding of the result (Triton; the
            torch path rounds the SwiGLU first, as ``F.silu(g) * u * w`` does); None: no weight.
        out: ``[M, I]`` buffer to write into (its padding rows are left as they are on the
            Triton path); default a fresh one.
        config: how the kernel is launched (:class:`LaunchConfig`; default :data:`DEFAULT_CONFIGS`).
    Raises:
        ValueError: ``h13`` not ``[M, 2I]``, ``M`` not the layout's capacity, columns not
            contiguous or ``I`` not a multiple of 8 (Triton path), ``row_w`` not ``[M]``.
    """
    kernel = select.use_triton(h13_MI2)
    i = _check("swiglu_fwd", h13_MI2, layout, kernel)
    m = h13_MI2.shape[0]
    if out is not None:
        _check_same("swiglu_fwd", "out", out, (m, i), True)
    if row_w is not None:
        _check_same("swiglu_fwd", "row_w", row_w, (m,), kernel)
    if not kernel:
        ref = swiglu_fwd_torch(h13_MI2, row_w)
        return ref if out is None else out.copy_(ref)
    out = h13_MI2.new_empty(m, i) if out is None else out
    if m == 0 or i == 0:
        return out
    _launch(OP_FWD, h13_MI2, layout, out, row_w=row_w.contiguous() if row_w is not None else None, config=config)
    return out


def swiglu_bwd(h13_MI2: torch.Tensor, dout_MI: torch.Tensor, layout: ExpertLayout | None = None,
               row_w_M: torch.Tensor | None = None, *, row_w_grad: bool = False, out: torch.Tensor | None = None,
               config: LaunchConfig | None = None):
    """Gradient ``[M, 2I]`` (d gate || d up) of :func:`swiglu_fwd`, in ``h13``'s dtype.

    With ``row_w_M`` (``[M]``, the folded routing weights) it is the gradient of
    ``swiglu_fwd(h13) · row_w`` given ``dout`` = d(that product): the weight (rounded to
    ``h13``'s dtype, as the forward multiplied it) scales ``dout`` in fp32 registers, so no
    scaled ``[M, I]`` copy of ``dout`` is made. With ``row_w_grad`` it returns the pair
    ``(d h13, d row_w)``: ``d row_w [M]`` fp32 (fp64 for fp64 inputs) is
    ``Σ_j dout_j · swiglu_j`` over the row, the SwiGLU unrounded, computed in the same pass
    (one fp32 partial per column block, summed after). With a layout, padding rows of the
    results (``out`` if given, ``[M, 2I]``) are left unwritten / unspecified (Triton path).
    Raises ValueError as :func:`swiglu_fwd`, and on a ``dout`` that is not ``[M, I]`` or a
    ``row_w`` that is not ``[M]``.
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
        ref = swiglu_bwd_torch(h13_MI2, dout_MI, row_w_M, row_w_grad)
        if out is None:
            return ref
        if row_w_grad:
            return out.copy_(ref[0]), ref[1]
        return out.copy_(ref)
    dh = h13_MI2.new_empty(m, 2 * i) if out is None else out
    cfg = config or DEFAULT_CONFIGS[OP_BWD]
    # d row_w: one fp32 partial per row per column block (summed below; a view when there is one block)
    parts = torch.empty(m, -(-i // _block_n(i, OP_BWD, cfg)), dtype=torch.float32,
                        device=h13_MI2.device) if row_w_grad else None
    if m and i:
        _launch(OP_BWD, h13_MI2, layout, dh, dout=dout_MI,
                row_w=row_w_M.contiguous() if row_w_M is not None else None, dw=parts, config=cfg)
    if not row_w_grad:
        return dh
    return dh, (parts[:, 0] if parts.shape[1] == 1 else parts.sum(1))


def swiglu_quant(h13_MI2: torch.Tensor, layout: ExpertLayout | None = None, ue8m0: bool = False, *,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None, config: LaunchConfig | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
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
    _launch(OP_QUANT, h13_MI2, layout, q, scale=scale, ue8m0=ue8m0, config=config)
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
    computed (docs/design.md#the-live-row-contract, rule 3) and padding rows of the result and of its gradient stay
    unwritten; elsewhere every row is computed (padding rows give garbage, never read).
    Without a ``layout`` it is the plain torch expression (any rows, autograd of the torch ops).
    """
    if layout is None:
        return swiglu_fwd_torch(h13_MI2)
    return _SwiGLU.apply(h13_MI2, layout)
