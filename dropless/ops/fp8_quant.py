"""FP8 (e4m3) quantisation of rows (one scale per row, or per row per 128 columns) over the live rows of a layout.

Ops (each picks its Triton kernel or its torch reference in one place, :func:`dropless.ops.select.use_triton`):

* :func:`quant_rows` — ``x [M, K]`` -> ``(q [M, K] e4m3, scale [M] fp32)`` with
  ``x[r] ≈ q[r] · scale[r]``: one scale per row (the rowwise operand of
  ``torch._scaled_grouped_mm``); with ``group=128``, ``scale [M, K/128]``, one per row per
  128 columns (the 1×128 activation operand of DeepGEMM's grouped GEMM).
* :func:`swiglu_quant_rows` — ``h13 [M, 2I]`` (gate = first ``I`` columns) ->
  ``(q [M, I], scale [M])`` of ``silu(gate) · up`` in one pass; the SwiGLU is computed
  in fp32 and quantised from fp32 (never rounded to bf16 first).
* :func:`quant_token_blocks` — ``x [M, K]`` -> ``(qT [K, M'] e4m3, scale [M'/128, K] fp32)``:
  one scale per column per 128-row block, the codes stored transposed (rows contiguous), as
  the FP8 weight-gradient GEMM (:func:`dropless.ops.triton_wgrad.fp8_grouped_wgrad_`) reads
  its operands: there the rows are the contracted dimension.
* :func:`quant_weight` — a per-output-channel e4m3 copy of an expert weight, laid out as
  the scaled grouped GEMM reads its right operand (column-major ``[e, K, N]``).
* :func:`quant_weight_blocks` — a 128×128-block e4m3 copy ``[e, N, K]`` (K-major) with
  ``scale [e, N/128, K/128]`` (DeepGEMM's weight operand).

Scales: ``scale = max(amax, 1e-12) / 448`` (448 = largest finite e4m3), so ``|q| <= 448``;
with ``ue8m0`` the power-of-two ceiling of that (exactly representable in UE8M0), read from the
fp32 scale's bits (:mod:`dropless.ops.ue8m0`: DeepGEMM's scales bit for bit, ``amax / scale <= 448``).
With a layout, the Triton row kernel walks the live rows ``[start[i], end[i])`` of the experts only: a
fixed 1-D grid (about the GPU's resident capacity, from the host-known capacity ``M`` and SM count)
whose programs number the live blocks of all experts themselves from the device-side ``start`` / ``end``
and take blocks ``p, p + G, …`` (:mod:`dropless.ops.flat_tiles`; a block is ``BLOCK_M`` whole rows with
one scale per row, ``BLOCK_M`` rows × up to 1,024 columns with ``group=128``), so the time follows the live
rows: padding rows and empty experts cost no program, and padding rows of ``q`` and ``scale`` stay
unwritten (docs/design.md#the-live-row-contract, rule 2-3).
The torch references compute every row.

Non-finite input: a live row holding NaN or ±Inf has no usable scale. Every op here counts
such rows into a device-side flag and raises through :func:`torch._assert_async` (no host
sync; on CUDA the failure surfaces as a device-side assert at the next synchronisation),
rather than letting a NaN scale flow into the GEMMs.
"""

from __future__ import annotations

import torch

from dropless.layout import ExpertLayout
from dropless.ops import select
from dropless.ops.flat_tiles import grid_size
from dropless.ops.ue8m0 import FP8_MAX, amax_scale, pow2_ceil  # FP8_MAX: the one definition (448)

FP8_DTYPE = torch.float8_e4m3fn
SCALE_EPS = 1e-12  # floor of amax, so an all-zero row gets a finite scale

NONFINITE_MSG = ("dropless gemm=fp8: a live row holds NaN or Inf, so its FP8 scale is not finite; the "
                 "activations or gradients diverged upstream (lower the learning rate, check the loss scale)")

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    from dropless.ops.flat_tiles import flat_expert, flat_unit, live_tiles
    from dropless.ops.ue8m0 import pow2_ceil_bits

    @triton.jit
    def _quant_block(x_ptr, q_ptr, s_ptr, flag_ptr, r0, hi, c0, K, stride_x, stride_q, stride_s,
                     SWIGLU: tl.constexpr, UE8M0: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """Rows ``[r0, min(r0 + BLOCK_M, hi))``, columns ``[c0, c0 + BLOCK_K)`` (below ``K``); with
        ``GROUP == 0`` the block holds whole rows (``c0 == 0``, ``BLOCK_K >= K``)."""
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < hi
        r64 = rows.to(tl.int64)[:, None]
        cols = c0 + tl.arange(0, BLOCK_K)[None, :]
        mask = rmask[:, None] & (cols < K)
        xp = x_ptr + r64 * stride_x + cols
        if SWIGLU:
            g = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(xp + K, mask=mask, other=0.0).to(tl.float32)
            a = g * tl.sigmoid(g) * u
        else:
            a = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        # NaN fails every comparison, Inf fails this one: count the non-finite elements
        bad = tl.sum(tl.sum(tl.where(mask & ~(tl.abs(a) <= 3.4028234663852886e38), 1, 0), axis=1), axis=0)
        if GROUP == 0:  # one scale per row
            amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12)
            scale = tl.math.div_rn(amax, 448.0)
            if UE8M0:
                scale = pow2_ceil_bits(scale)
            q = tl.clamp(tl.math.div_rn(a, scale[:, None]), -448.0, 448.0)
            tl.store(s_ptr + rows, scale, mask=rmask)
        else:  # one scale per row per GROUP columns (K a multiple of GROUP; BLOCK_K of them)
            a3 = tl.reshape(a, (BLOCK_M, BLOCK_K // GROUP, GROUP))
            amax = tl.maximum(tl.max(tl.abs(a3), axis=2), 1e-12)
            scale = tl.math.div_rn(amax, 448.0)
            if UE8M0:
                scale = pow2_ceil_bits(scale)
            q = tl.reshape(tl.clamp(tl.math.div_rn(a3, scale[:, :, None]), -448.0, 448.0), (BLOCK_M, BLOCK_K))
            grp = c0 // GROUP + tl.arange(0, BLOCK_K // GROUP)[None, :]
            tl.store(s_ptr + r64 * stride_s + grp, scale, mask=rmask[:, None] & (grp * GROUP < K))
        tl.store(q_ptr + r64 * stride_q + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=mask)
        tl.atomic_max(flag_ptr, bad, mask=bad > 0)

    @triton.jit
    def _quant_kernel(x_ptr, q_ptr, s_ptr, flag_ptr, start_ptr, end_ptr, M, E, K, stride_x, stride_q, stride_s,
                      HAS_LAYOUT: tl.constexpr, SWIGLU: tl.constexpr, UE8M0: tl.constexpr, GROUP: tl.constexpr,
                      NUM_KB: tl.constexpr, EP: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        # blocks of BLOCK_M rows x BLOCK_K columns (NUM_KB = 1 with one scale per row: the whole row in one
        # block). With a layout, the live blocks of every expert in one flat numbering (flat_tiles.py);
        # without, block t covers rows (t // NUM_KB)·BLOCK_M and columns (t % NUM_KB)·BLOCK_K of all M rows.
        # Program p takes blocks p, p + G, …
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        if HAS_LAYOUT:
            ar, nb_v, cum_v, start_v, end_v, n = live_tiles(start_ptr, end_ptr, M, E, EP, NUM_KB, BLOCK_M)
            if INTERPRET:  # the interpreter's scalars are 1-element arrays, which range() rejects
                t = pid + n * 0
                while t < n:
                    r0, hi, c0 = flat_unit(t, ar, nb_v, cum_v, start_v, end_v, NUM_KB, BLOCK_M, BLOCK_K)
                    _quant_block(x_ptr, q_ptr, s_ptr, flag_ptr, r0, hi, c0, K, stride_x, stride_q, stride_s, SWIGLU,
                                 UE8M0, GROUP, BLOCK_M, BLOCK_K)
                    t += nprog
            else:
                for t in range(pid, n, nprog):
                    r0, hi, c0 = flat_unit(t, ar, nb_v, cum_v, start_v, end_v, NUM_KB, BLOCK_M, BLOCK_K)
                    _quant_block(x_ptr, q_ptr, s_ptr, flag_ptr, r0, hi, c0, K, stride_x, stride_q, stride_s, SWIGLU,
                                 UE8M0, GROUP, BLOCK_M, BLOCK_K)
        else:
            lo = M * 0
            hi = M
            n = (tl.maximum(hi - lo, 0) + BLOCK_M - 1) // BLOCK_M * NUM_KB
            if INTERPRET:
                t = pid + lo
                while t < n:
                    _quant_block(x_ptr, q_ptr, s_ptr, flag_ptr, lo + (t // NUM_KB) * BLOCK_M, hi,
                                 (t % NUM_KB) * BLOCK_K, K, stride_x, stride_q, stride_s, SWIGLU, UE8M0, GROUP,
                                 BLOCK_M, BLOCK_K)
                    t += nprog
            else:
                for t in range(pid, n, nprog):
                    _quant_block(x_ptr, q_ptr, s_ptr, flag_ptr, lo + (t // NUM_KB) * BLOCK_M, hi,
                                 (t % NUM_KB) * BLOCK_K, K, stride_x, stride_q, stride_s, SWIGLU, UE8M0, GROUP,
                                 BLOCK_M, BLOCK_K)

    @triton.jit
    def _quant_cols_kernel(w_ptr, q_ptr, s_ptr, N, stride_we, stride_wk, stride_wn, K: tl.constexpr,
                           UE8M0: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program ``(i, j)``: columns ``[j·BLOCK_N, …)`` of ``w[i]`` (``[K, N]``, any strides): one scale
        per column over all ``K`` rows, then the e4m3 columns written as rows of ``q[i]`` (``[N, K]``
        contiguous), transposed in registers. A column holding NaN/Inf gets a NaN scale. ``K`` is a
        compile-time constant (a weight's dimension: one compilation per model shape)."""
        ex = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        base = w_ptr + ex * stride_we + cols[None, :].to(tl.int64) * stride_wn
        amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
        bad = tl.zeros((BLOCK_N,), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            m = (ks[:, None] < K) & cmask[None, :]
            a = tl.load(base + ks[:, None].to(tl.int64) * stride_wk, mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(a), axis=0))
            bad += tl.sum(tl.where(m & ~(tl.abs(a) <= 3.4028234663852886e38), 1, 0), axis=0)
        amax = tl.maximum(amax, 1e-12)
        scale = tl.math.div_rn(amax, 448.0)  # _quant_block's expressions: equal scales and codes bit for bit
        if UE8M0:
            scale = pow2_ceil_bits(scale)
        scale = tl.where(bad > 0, float("nan"), scale)
        tl.store(s_ptr + ex * N + cols, scale, mask=cmask)
        qbase = q_ptr + ex * N * K + cols[:, None].to(tl.int64) * K
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            m = (ks[:, None] < K) & cmask[None, :]
            a = tl.load(base + ks[:, None].to(tl.int64) * stride_wk, mask=m, other=0.0).to(tl.float32)
            q = tl.clamp(tl.math.div_rn(a, scale[None, :]), -448.0, 448.0)
            q = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(qbase + ks[None, :], tl.trans(q), mask=(ks[None, :] < K) & cmask[:, None])

    @triton.jit
    def _quant_tok_tile(x_ptr, q_ptr, s_ptr, flag_ptr, r0, hi, ex, c0, K, stride_x, stride_q, UE8M0: tl.constexpr,
                        PASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Rows ``[r0, r0 + BLOCK_R)`` of expert ``ex`` (live below ``hi``), columns ``[c0, c0 + BLOCK_K)``."""
        b = r0 // BLOCK_R
        rows = r0 + tl.arange(0, BLOCK_R)
        live = rows < hi
        r64 = rows.to(tl.int64)
        cols = c0 + tl.arange(0, BLOCK_K)
        cmask = cols < K
        m = live[:, None] & cmask[None, :]
        a = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if PASS < 2:  # count the non-finite elements once (pass 2 reads the same rows again)
            bad = tl.sum(tl.sum(tl.where(m & ~(tl.abs(a) <= 3.4028234663852886e38), 1, 0), axis=1), axis=0)
            tl.atomic_max(flag_ptr, bad, mask=bad > 0)
        if PASS == 1:
            tl.atomic_max(s_ptr + ex.to(tl.int64) * K + cols, tl.max(tl.abs(a), axis=0), mask=cmask)
        else:
            if PASS == 0:
                amax = tl.maximum(tl.max(tl.abs(a), axis=0), 1e-12)
                scale = tl.math.div_rn(amax, 448.0)  # the expressions of _quant_block
                if UE8M0:
                    scale = pow2_ceil_bits(scale)
                tl.store(s_ptr + b.to(tl.int64) * K + cols, scale, mask=cmask)
            else:
                scale = tl.load(s_ptr + ex.to(tl.int64) * K + cols, mask=cmask, other=1.0)
            q = tl.clamp(tl.math.div_rn(a, scale[None, :]), -448.0, 448.0)
            q = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            # q^T [K, M']: rows contiguous
            tl.store(q_ptr + cols[:, None].to(tl.int64) * stride_q + r64[None, :], tl.trans(q), mask=cmask[:, None])

    @triton.jit
    def _quant_tok_kernel(x_ptr, q_ptr, s_ptr, flag_ptr, start_ptr, end_ptr, M, E, K, stride_x, stride_q,
                          UE8M0: tl.constexpr, EP: tl.constexpr, PASS: tl.constexpr, NUM_CB: tl.constexpr,
                          INTERPRET: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Tiles of ``BLOCK_R`` rows (one scale block) × ``BLOCK_K`` columns over the live row blocks of every
        expert, in one flat numbering (flat_tiles.py; program ``p`` takes tiles ``p, p + G, …``).

        A block belongs to one expert ``i`` (every start a multiple of ``BLOCK_R``, so a block never holds
        two experts' rows); a block in a gap or past the last live row is no tile and stays unwritten.
        Rows at or past ``end[i]`` are written as zeros (the GEMM reads whole blocks) and never read
        from ``x``. ``PASS`` 0: codes with the block's own scales, written to ``s [M'/128, K]``; 1: only
        the columns' amax, into the expert's row of ``s [e, K]`` (atomic max; ``s`` zeroed first); 2:
        codes with the expert's scales read from ``s [e, K]``."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        ar, nb_v, cum_v, start_v, end_v, n = live_tiles(start_ptr, end_ptr, M, E, EP, NUM_CB, BLOCK_R)
        if INTERPRET:  # the interpreter's scalars are 1-element arrays, which range() rejects
            t = pid + n * 0
            while t < n:
                r0, hi, c0 = flat_unit(t, ar, nb_v, cum_v, start_v, end_v, NUM_CB, BLOCK_R, BLOCK_K)
                _quant_tok_tile(x_ptr, q_ptr, s_ptr, flag_ptr, r0, hi, flat_expert(t, cum_v), c0, K, stride_x,
                                stride_q, UE8M0, PASS, BLOCK_R, BLOCK_K)
                t += nprog
        else:
            for t in range(pid, n, nprog):
                r0, hi, c0 = flat_unit(t, ar, nb_v, cum_v, start_v, end_v, NUM_CB, BLOCK_R, BLOCK_K)
                _quant_tok_tile(x_ptr, q_ptr, s_ptr, flag_ptr, r0, hi, flat_expert(t, cum_v), c0, K, stride_x,
                                stride_q, UE8M0, PASS, BLOCK_R, BLOCK_K)


#: The 1x128 launch (``group=128``): blocks of 4 rows x up to 1,024 columns (8 scale groups), each
#: independent of the others, 32 programs per SM (the tile shape the SwiGLU kernels measured best).
GROUP_BLOCK = (4, 1024, 4, 32)  # (rows, columns, warps, programs per SM)
#: The one-scale-per-row launch over a layout's live rows, ``(rows, warps, programs per SM)`` of a block
#: holding whole rows: up to 1,024 columns the best at K = 512 / 1,024 over 64 experts, wider the best at
#: K 2,048-7,168 over the per-rank shape's 4 experts (benchmarks/results/fp8_kernels.jsonl).
ROW_BLOCK_NARROW, ROW_BLOCK_WIDE = (4, 4, 32), (1, 8, 32)


def _launch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, flag: torch.Tensor, layout: ExpertLayout | None,
            k: int, swiglu: bool, ue8m0: bool, group: int) -> None:
    m = x.shape[0]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    if group:  # the scales need no whole-row reduction: tile the columns too
        block_m, block_k, num_warps, per_sm = GROUP_BLOCK
        block_k = min(block_k, triton.next_power_of_2(k))
    else:  # one scale per row: a block holds whole rows
        block_k = triton.next_power_of_2(k)
        if block_k <= 1024 and layout is not None:
            block_m, num_warps, per_sm = ROW_BLOCK_NARROW
        elif layout is not None:
            block_m, num_warps, per_sm = ROW_BLOCK_WIDE
        else:  # 8-16 KiB of input per block
            block_m = max(1, min(16, 8192 // block_k))
            num_warps, per_sm = (8 if block_k * block_m >= 4096 else 4), 8
    num_kb = -(-k // block_k)
    tiles = max(1, -(-m // block_m)) * num_kb
    if layout is not None:  # a flat grid over the live blocks of every expert (flat_tiles.py)
        e = layout.num_experts
        if e == 0:
            return
        grid = (grid_size(tiles, e, num_kb, sms * per_sm),)
        start, end = layout.start, layout.end
    else:
        e = 1
        grid = (max(1, min(tiles, sms * per_sm)),)
        start = end = flag
    _quant_kernel[grid](x, q, s, flag, start, end, m, e, k, x.stride(0), q.stride(0), s.stride(0),
                        HAS_LAYOUT=layout is not None, SWIGLU=swiglu, UE8M0=ue8m0, GROUP=group, NUM_KB=num_kb,
                        EP=triton.next_power_of_2(max(e, 2)), INTERPRET=select.interpreting(), BLOCK_M=block_m,
                        BLOCK_K=block_k, num_warps=num_warps)


def _quant_torch(a: torch.Tensor, ue8m0: bool, group: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: ``(q, scale, number of non-finite elements)`` of fp32 ``a [M, K]``, every row.

    ``group`` 0: ``scale [M]``; else ``scale [M, K/group]`` (``K`` a multiple of ``group``).
    """
    bad = (~torch.isfinite(a)).sum()
    m, k = a.shape
    a3 = a.view(m, 1, k) if group == 0 else a.view(m, k // group, group)
    scale = amax_scale(a3.abs().amax(-1), SCALE_EPS)
    if ue8m0:
        scale = pow2_ceil(scale)
    q = (a3 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, k)
    return q, (scale.view(m) if group == 0 else scale), bad


def _check(name: str, x: torch.Tensor, layout: ExpertLayout | None, k: int | None = None, group: int = 0) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: need a 2-D [M, K] input, got {tuple(x.shape)}")
    if group not in (0, 128):
        raise ValueError(f"{name}: group={group}: 0 (one scale per row) or 128 (one per row per 128 columns)")
    if group and k is not None and k % group:
        raise ValueError(f"{name}: {k} columns are not a multiple of the 1x{group} scale groups")
    if layout is not None and x.shape[0] != layout.capacity:
        raise ValueError(f"{name}: {x.shape[0]} rows but the layout's capacity M is {layout.capacity}; "
                         "pass the whole landed buffer")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: takes fp32/bf16/fp16, got {x.dtype}")


def _rows_op(name: str, x: torch.Tensor, layout: ExpertLayout | None, swiglu: bool, ue8m0: bool,
             check_finite: bool, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0] if x.dim() == 2 else 0
    k = (x.shape[1] // 2 if swiglu else x.shape[1]) if x.dim() == 2 else None
    _check(name, x, layout, k, group)
    if select.use_triton(x):
        if x.stride(1) != 1:
            x = x.contiguous()
        q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
        s = torch.empty((m, k // group) if group else (m,), dtype=torch.float32, device=x.device)
        flag = torch.zeros(1, dtype=torch.int32, device=x.device)
        if m and k:
            _launch(x, q, s, flag, layout, k, swiglu, ue8m0, group)
        bad = flag[0]
    else:
        a = x.float()
        if swiglu:
            g, u = a[:, :k], a[:, k:]
            a = g * torch.sigmoid(g) * u
        if layout is not None:  # the reference checks live rows only, as the kernel does
            a = torch.where(layout.live_mask().unsqueeze(1), a, torch.zeros((), dtype=a.dtype, device=a.device))
        q, s, bad = _quant_torch(a, ue8m0, group)
    if check_finite:
        torch._assert_async(bad == 0, NONFINITE_MSG)
    return q, s


def quant_rows(x_MK: torch.Tensor, layout: ExpertLayout | None = None, ue8m0: bool = False,
               check_finite: bool = True, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantisation of the rows of ``x_MK``: one scale per row, or per row per 128 columns.

    Args:
        x_MK: ``[M, K]`` fp32/bf16/fp16 (padding rows may hold anything, NaN included).
        layout: with it, live rows only (Triton path: padding rows of the results unwritten).
        ue8m0: power-of-two scales.
        check_finite: raise (device-side, :func:`torch._assert_async`) when a live row holds NaN/Inf.
        group: 0 for one scale per row; 128 for one per row per 128 columns (``K`` a multiple
            of 128; the 1×128 layout).
    Returns:
        ``q [M, K]`` float8_e4m3fn (row-major) and ``scale`` fp32: ``[M]`` with
        ``x[r] ≈ q[r] · scale[r]``, or ``[M, K/128]`` with
        ``x[r, c] ≈ q[r, c] · scale[r, c // 128]``.
    Raises:
        ValueError: not 2-D, ``M`` not the layout's capacity, an unsupported dtype, a group
            other than 0/128, or ``K`` not a multiple of the group.
        RuntimeError: (asynchronously on CUDA) a live row is not finite.
    """
    return _rows_op("quant_rows", x_MK, layout, False, ue8m0, check_finite, group)


def swiglu_quant_rows(h13_MI2: torch.Tensor, layout: ExpertLayout | None = None, ue8m0: bool = False,
                      check_finite: bool = True, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu(gate) · up`` of ``h13 [M, 2I]`` quantised to e4m3 in one pass.

    Returns ``q [M, I]`` float8_e4m3fn and ``scale`` fp32 (``[M]``, or ``[M, I/128]`` with
    ``group=128``); otherwise as :func:`quant_rows` (the non-finite check applies to the
    SwiGLU output).
    """
    if h13_MI2.dim() == 2 and h13_MI2.shape[1] % 2:
        raise ValueError(f"swiglu_quant_rows: h13 must be [M, 2I] (gate || up), got {tuple(h13_MI2.shape)}")
    return _rows_op("swiglu_quant_rows", h13_MI2, layout, True, ue8m0, check_finite, group)


TOKEN_BLOCK = 128  # rows per scale block of quant_token_blocks (the FP8 weight gradient's contracted dim)
TOKEN_COLS, TOKEN_WARPS = 64, 4  # columns per tile and warps of the token-block kernels (the best of 5
#                                   launches at K 7,168 / 4,096: benchmarks/results/moe_layer.jsonl)
TOKEN_PER_SM = 16  # programs per SM of their flat grid (4-warp programs: 64 warps, an SM's most)


def _tok_launch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, flag: torch.Tensor, layout: ExpertLayout,
                pass_: int, ue8m0: bool) -> None:
    """The token-block kernel's pass ``pass_`` on a flat grid over the live 128-row blocks (flat_tiles.py)."""
    m, k = x.shape
    e, ncb = layout.num_experts, triton.cdiv(k, TOKEN_COLS)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    grid = (grid_size(-(-m // TOKEN_BLOCK) * ncb, e, ncb, sms * TOKEN_PER_SM),)
    _quant_tok_kernel[grid](x, q, s, flag, layout.start, layout.end, m, e, k, x.stride(0), q.stride(0), UE8M0=ue8m0,
                            EP=triton.next_power_of_2(max(e, 2)), PASS=pass_, NUM_CB=ncb,
                            INTERPRET=select.interpreting(), BLOCK_R=TOKEN_BLOCK, BLOCK_K=TOKEN_COLS,
                            num_warps=TOKEN_WARPS)


def _token_shape(name: str, x_MK: torch.Tensor, layout: ExpertLayout) -> tuple[int, int, int, int]:
    """``(M, K, blocks, M')`` of a row-contracted operand, after the checks shared by its two quantisers."""
    _check(name, x_MK, layout)
    if layout.alignment % TOKEN_BLOCK:
        raise ValueError(f"{name}: expert_alignment={layout.alignment}: the FP8 weight gradient needs every "
                         f"expert's rows to start on a {TOKEN_BLOCK}-row block (set model.expert_alignment to a "
                         f"multiple of {TOKEN_BLOCK})")
    m, k = x_MK.shape
    nblk = -(-m // TOKEN_BLOCK)
    return m, k, nblk, nblk * TOKEN_BLOCK


def quant_token_blocks(x_MK: torch.Tensor, layout: ExpertLayout, ue8m0: bool = False, check_finite: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantisation with one scale per column per 128-row block, over the live rows of ``layout``.

    The operand of a GEMM that contracts over the rows (the weight gradient ``x^T @ dy``): the
    scales run along the columns (the GEMM's output channels) and change every 128 rows
    (DeepSeek-V3 §3.3.2's 1×128 tiles, oriented along the tokens).

    Args:
        x_MK: ``[M, K]`` fp32/bf16/fp16 landed rows (padding rows may hold anything, NaN included).
        layout: the rows' layout; every segment start must be a multiple of 128
            (``layout.alignment`` a multiple of 128), so no block holds two experts' rows.
        ue8m0: power-of-two scales.
        check_finite: raise (device-side) when a live row holds NaN/Inf.
    Returns:
        ``(qT, scale)``: ``M' = ceil(M / 128)·128``; ``qT [K, M']`` e4m3 (rows contiguous: what the
        GEMM's tensor cores read without a transpose), ``scale [M'/128, K]`` fp32 with
        ``x[r, c] ≈ qT[c, r] · scale[r // 128, c]``. In a block
        holding live rows, the rows past the expert's end are zero codes; blocks holding no live
        row (alignment gaps, the tail) are left unwritten on the Triton path. A block's scale
        covers its live rows only.
    Raises:
        ValueError: not 2-D, ``M`` not the layout's capacity, an unsupported dtype, or an
            alignment that is not a multiple of 128.
        RuntimeError: (asynchronously on CUDA) a live row is not finite.
    """
    m, k, nblk, mp = _token_shape("quant_token_blocks", x_MK, layout)
    if select.use_triton(x_MK):
        x = x_MK if x_MK.stride(1) == 1 else x_MK.contiguous()
        q = torch.empty(k, mp, dtype=FP8_DTYPE, device=x.device)
        s = torch.empty(nblk, k, dtype=torch.float32, device=x.device)
        flag = torch.zeros(1, dtype=torch.int32, device=x.device)
        e = layout.num_experts
        if nblk and k and e:
            _tok_launch(x, q, s, flag, layout, 0, ue8m0)
        bad = flag[0]
    else:
        a = torch.where(layout.live_mask().unsqueeze(1), x_MK.float(), torch.zeros((), device=x_MK.device))
        bad = (~torch.isfinite(a)).sum()
        a = torch.cat([a, a.new_zeros(mp - m, k)]).view(nblk, TOKEN_BLOCK, k)
        s = amax_scale(a.abs().amax(1), SCALE_EPS)
        if ue8m0:
            s = pow2_ceil(s)
        q = (a / s.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(mp, k).t().contiguous()
    if check_finite:
        torch._assert_async(bad == 0, NONFINITE_MSG)
    return q, s


def quant_expert_columns(x_MK: torch.Tensor, layout: ExpertLayout, ue8m0: bool = False, check_finite: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantisation with one scale per column per expert (all of the expert's live rows), codes transposed.

    The other operand form of the FP8 weight gradient (``promote=False`` of
    :func:`dropless.ops.triton_wgrad.fp8_grouped_wgrad_`): the scales apply once to each
    expert's summed product instead of to every 128-row block's (torchao's per-group column
    scales for the grouped weight gradient). Two passes over ``x``: the columns' amax per
    expert, then the codes.

    Args: as :func:`quant_token_blocks`.
    Returns:
        ``(qT [K, M'], scale [e, K])``: ``x[r, c] ≈ qT[c, r] · scale[i, c]`` for a live row ``r`` of
        expert ``i``; zero codes in the rows past an expert's end up to its next 128-row
        boundary; gap and tail blocks unwritten (Triton path). An empty expert's scales are
        ``1e-12 / 448``.
    Raises:
        As :func:`quant_token_blocks`.
    """
    m, k, nblk, mp = _token_shape("quant_expert_columns", x_MK, layout)
    e = layout.num_experts
    if select.use_triton(x_MK):
        x = x_MK if x_MK.stride(1) == 1 else x_MK.contiguous()
        q = torch.empty(k, mp, dtype=FP8_DTYPE, device=x.device)
        amax = torch.zeros(e, k, dtype=torch.float32, device=x.device)
        flag = torch.zeros(1, dtype=torch.int32, device=x.device)
        if nblk and k and e:
            _tok_launch(x, q, amax, flag, layout, 1, ue8m0)
        s = amax_scale(amax, SCALE_EPS)
        if ue8m0:
            s = pow2_ceil(s)
        if nblk and k and e:
            _tok_launch(x, q, s, flag, layout, 2, ue8m0)
        bad = flag[0]
    else:
        live = layout.live_mask()
        a = torch.where(live.unsqueeze(1), x_MK.float(), torch.zeros((), device=x_MK.device))
        bad = (~torch.isfinite(a)).sum()
        rex = layout.row_expert().clamp(0, max(e - 1, 0))
        amax = torch.zeros(e, k, dtype=torch.float32, device=x_MK.device)
        amax.scatter_reduce_(0, rex[live].unsqueeze(1).expand(-1, k), a[live].abs(), reduce="amax")
        s = amax_scale(amax, SCALE_EPS)
        if ue8m0:
            s = pow2_ceil(s)
        q = (a / s[rex]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        q = torch.cat([q, q.new_zeros(mp - m, k)]).t().contiguous()
    if check_finite:
        torch._assert_async(bad == 0, NONFINITE_MSG)
    return q, s


def quant_weight(w_eKN: torch.Tensor, contract_dim: int = 1, ue8m0: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3 copy of an expert weight, as the right operand of the scaled grouped GEMM.

    Args:
        w_eKN: ``[e, A, B]`` weight (any float dtype; quantised from its own precision).
        contract_dim: the dimension the GEMM contracts over: 1 for ``x @ w`` (forward,
            output channels along dim 2), 2 for ``dy @ wᵀ`` (data gradient, output
            channels along dim 1).
        ue8m0: power-of-two scales.
    Returns:
        ``(b, scale)``: ``b`` the ``[e, K, N]`` column-major e4m3 operand (``K`` = the contracted
        size; a transposed view of a contiguous ``[e, N, K]`` buffer, as ``torch._scaled_grouped_mm``
        requires), ``scale [e, N]`` fp32 with ``w ≈ b · scale`` per output channel.
        Raises (device-side) when a scale is not finite (a NaN/Inf weight).
    """
    if w_eKN.dim() != 3 or contract_dim not in (1, 2):
        raise ValueError(f"quant_weight: need w [e, K, N] and contract_dim 1 or 2, got {tuple(w_eKN.shape)}, "
                         f"{contract_dim}")
    w = w_eKN.detach()
    e = w.shape[0]
    w_NK = w.transpose(1, 2) if contract_dim == 1 else w  # output channels first, contracted dim last
    n, k = w_NK.shape[1], w_NK.shape[2]
    if select.use_triton(w) and w_NK.stride(2) != 1 and n and k:
        # the forward operand: one pass reads w's columns and writes them as e4m3 rows of [e, N, K]
        # (no transposing bf16 copy first; that copy alone took 4x the quantisation on an H200)
        q = torch.empty((e, n, k), dtype=FP8_DTYPE, device=w.device)
        scale = torch.empty((e, n), dtype=torch.float32, device=w.device)
        _quant_cols_kernel[(e, triton.cdiv(n, 64))](w_NK, q, scale, n, w_NK.stride(0), w_NK.stride(2),
                                                     w_NK.stride(1), K=k, UE8M0=ue8m0, BLOCK_K=128, BLOCK_N=64,
                                                     num_warps=4)
    else:
        # [e, N, K] contiguous, then one rowwise pass (quant_rows' kernel on CUDA: amax, scale and the
        # e4m3 copy together)
        w_NK = w_NK.contiguous()
        q, scale = quant_rows(w_NK.view(e * n, k), None, ue8m0, check_finite=False)
        scale = scale.view(e, n)
    torch._assert_async(torch.isfinite(scale).all(), "dropless gemm=fp8: an expert weight holds NaN or Inf")
    return q.view(e, n, k).transpose(1, 2), scale


BLOCK = 128  # DeepGEMM's weight block (128 x 128)


def quant_weight_blocks(w_eKN: torch.Tensor, contract_dim: int = 1, ue8m0: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """128×128-block e4m3 copy of an expert weight, as DeepGEMM's grouped GEMM reads its right operand.

    Args:
        w_eKN: ``[e, A, B]`` weight (any float dtype).
        contract_dim: the dimension the GEMM contracts over (1: ``x @ w``; 2: ``dy @ wᵀ``).
        ue8m0: power-of-two scales.
    Returns:
        ``(b, scale)``: ``b [e, N, K]`` e4m3, contiguous (K-major: the ``nt`` operand), and
        ``scale [e, N/128, K/128]`` fp32 with ``w[n, k] ≈ b[n, k] · scale[n // 128, k // 128]``
        (``w`` oriented ``[e, N, K]``). Raises (device-side) when a scale is not finite.
    Raises:
        ValueError: not 3-D, or ``N`` or ``K`` not a multiple of 128.
    """
    if w_eKN.dim() != 3 or contract_dim not in (1, 2):
        raise ValueError(f"quant_weight_blocks: need w [e, K, N] and contract_dim 1 or 2, got {tuple(w_eKN.shape)}, "
                         f"{contract_dim}")
    w = w_eKN.detach()
    w_NK = w.transpose(1, 2) if contract_dim == 1 else w
    e, n, k = w_NK.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"quant_weight_blocks: the weight's [N, K] = [{n}, {k}] is not a multiple of "
                         f"{BLOCK}x{BLOCK} blocks")
    # one fp32 copy, [e, N, K] contiguous (w_NK may be a transposed view)
    blocks = torch.empty((e, n, k), dtype=torch.float32, device=w.device).copy_(w_NK)
    blocks = blocks.view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = amax_scale(blocks.abs().amax(dim=(2, 4)), SCALE_EPS)
    if ue8m0:
        scale = pow2_ceil(scale)
    q = (blocks / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(e, n, k)
    torch._assert_async(torch.isfinite(scale).all(), "dropless gemm=deep_gemm: an expert weight holds NaN or Inf")
    return q, scale


def dequant_weight_blocks(b_eNK: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[e, N, K]`` of :func:`quant_weight_blocks`' operand (reference / emulation)."""
    return (b_eNK.float().unflatten(1, (scale.shape[1], -1)).unflatten(3, (scale.shape[2], -1))
            * scale[:, :, None, :, None]).flatten(3).flatten(1, 2)


def dequant_rows(q_MK: torch.Tensor, scale_M: torch.Tensor) -> torch.Tensor:
    """fp32 ``q · scale`` of :func:`quant_rows`' ``[M, K]`` (scale ``[M]`` or ``[M, K/G]``; reference / emulation)."""
    if scale_M.dim() == 1:
        return q_MK.float() * scale_M.unsqueeze(1)
    m, k = q_MK.shape
    g = k // scale_M.shape[1]
    return (q_MK.float().view(m, -1, g) * scale_M.unsqueeze(-1)).view(m, k)


def dequant_weight(b_eKN: torch.Tensor, scale_eN: torch.Tensor) -> torch.Tensor:
    """fp32 ``b · scale`` of :func:`quant_weight`'s ``[e, K, N]`` operand (reference / emulation)."""
    return b_eKN.float() * scale_eN.unsqueeze(1)
