"""FP8 quantisation where the expert rows are made: the landing gather and the combine's backward.

With an FP8 grouped GEMM (``gemm=fp8`` / ``deep_gemm``) two left operands are rows that a row
kernel has just written: FC1's input (the landed tokens) and FC2's data-gradient input (the
combine's backward, ``w · dy`` per choice). Quantising them in a separate pass re-reads the
whole ``[M, H]`` buffer; these ops write the e4m3 codes and scales in the pass that makes the
rows, with :func:`~dropless.ops.fp8_quant.quant_rows`' rule and layout
(docs/design.md#fp8-quantisation-in-the-row-kernels):

* :func:`scatter_quant_rows` — the landing of ``x_NH`` (:func:`~dropless.ops.rows.land_rows`)
  plus ``(codes [M, H] e4m3, scales [M] or [M, H/128] fp32)`` of the landed rows. A row's codes
  depend on that row alone, so each token is quantised once and its codes written to its
  ``k`` rows; the compute-dtype rows are written too only with ``keep_rows`` (a consumer
  of the rows themselves: FC1's weight gradient).
* :func:`combine_bwd_quant` — :func:`~dropless.ops.rows.combine_bwd` plus the codes and
  scales of the gradient rows it writes, quantised from the rows as written (rounded to the
  gradient's dtype first, as a separate pass would read them). A row is ``(g · w).to(dtype)``
  for the token's gradient ``g`` and the choice's weight ``w``; its amax (of the row, or of each
  1×128 group) is ``(amax|g| · |w|).to(dtype)`` bit for bit (both roundings are odd-symmetric and
  monotone), so the kernel reduces ``|g|`` once per token (per group) and derives each of the
  ``k`` rows' scales from it, instead of reducing the ``k`` rows.

Codes and scales equal :func:`~dropless.ops.fp8_quant.quant_rows` of the unfused op's output on
every live row, bit for bit (the same fp32 expressions: ``scale = max(amax, 1e-12) / 448``,
its power-of-two ceiling with ``ue8m0``, ``q = clamp(a / scale, ±448)`` rounded to nearest even);
padding rows of the codes and scales are unspecified (unwritten on the Triton path). A live
row holding NaN/Inf raises :data:`~dropless.ops.fp8_quant.NONFINITE_MSG` through
:func:`torch._assert_async`, as the separate quantisation does; a token landed nowhere is not
checked.

Each op picks its Triton kernel or its torch reference in one place
(:func:`dropless.ops.select.use_triton`); both give the same codes and scales (on the CPU
interpreter, Triton's e4m3 conversion does not round to nearest, so there the codes equal the
unfused Triton kernel's, not torch's).
"""

from __future__ import annotations

import torch

from dropless.ops import select
from dropless.ops.fp8_quant import FP8_DTYPE, NONFINITE_MSG, _quant_torch
from dropless.ops.rows import COMBINE_BWD_BLOCK_H, COMBINE_BWD_WARPS, combine_bwd_torch, gather_rows

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    from dropless.ops.ue8m0 import pow2_ceil_bits

    @triton.jit
    def _scale_of(amax, UE8M0: tl.constexpr):
        """fp8_quant's scale of an fp32 ``amax`` (the expressions of its row kernel)."""
        scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
        if UE8M0:
            scale = pow2_ceil_bits(scale)
        return scale

    @triton.jit
    def _codes(a, scale):
        return tl.clamp(tl.math.div_rn(a, scale), -448.0, 448.0)

    @triton.jit
    def _scatter_quant_kernel(x_ptr, dest_ptr, rows_ptr, q_ptr, s_ptr, flag_ptr, M, H, stride_x, stride_r,
                              stride_q, stride_s, K: tl.constexpr, KP: tl.constexpr, KEEP: tl.constexpr,
                              GROUP: tl.constexpr, UE8M0: tl.constexpr, NUM_HB: tl.constexpr,
                              BLOCK_H: tl.constexpr):
        """Program ``n``: token ``n`` read once, quantised once, its codes (and with ``KEEP`` the row) written
        to its ``k`` landed rows. ``GROUP`` 0: one scale per row (a first pass over the columns for the
        amax); 128: one per 128 columns (``BLOCK_H`` a multiple of 128, ``H`` of 128)."""
        n = tl.program_id(0)
        js = tl.arange(0, KP)
        d = tl.load(dest_ptr + n * K + js, mask=js < K, other=-1)
        ok = (d >= 0) & (d < M)
        d64 = tl.maximum(d, 0).to(tl.int64)
        token_live = tl.sum(ok.to(tl.int32), axis=0) > 0
        xrow = x_ptr + n.to(tl.int64) * stride_x
        bad = tl.zeros([BLOCK_H], dtype=tl.int32)
        if GROUP == 0:
            amax = tl.zeros([BLOCK_H], dtype=tl.float32)
            for hb in range(NUM_HB):
                cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
                a = tl.load(xrow + cols, mask=cols < H, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(a))
                bad += tl.where((cols < H) & ~(tl.abs(a) <= 3.4028234663852886e38), 1, 0)
            scale = _scale_of(tl.max(amax, axis=0), UE8M0)
            tl.store(s_ptr + d64 * stride_s, scale + tl.zeros([KP], dtype=tl.float32), mask=ok)
        for hb in range(NUM_HB):
            cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            cmask = cols < H
            v = tl.load(xrow + cols, mask=cmask, other=0.0)
            a = v.to(tl.float32)
            if GROUP == 0:
                q = _codes(a, scale)
            else:
                bad += tl.where(cmask & ~(tl.abs(a) <= 3.4028234663852886e38), 1, 0)
                a2 = tl.reshape(a, (BLOCK_H // GROUP, GROUP))
                sg = _scale_of(tl.max(tl.abs(a2), axis=1), UE8M0)
                q = tl.reshape(_codes(a2, sg[:, None]), (BLOCK_H,))
                grp = hb * (BLOCK_H // GROUP) + tl.arange(0, BLOCK_H // GROUP)
                tl.store(s_ptr + d64[:, None] * stride_s + grp[None, :],
                         tl.broadcast_to(sg[None, :], (KP, BLOCK_H // GROUP)),
                         mask=ok[:, None] & (grp[None, :] * GROUP < H))
            q8 = q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            for j in tl.static_range(K):  # one row at a time: no [k, BLOCK_H] tile of addresses
                dj = tl.load(dest_ptr + n * K + j)
                # the test on a block, not the scalar: Triton's interpreter turns `block & scalar` into int32
                okj = cmask & ((cols * 0 + dj) >= 0) & ((cols * 0 + dj) < M)
                dj64 = tl.maximum(dj, 0).to(tl.int64)
                tl.store(q_ptr + dj64 * stride_q + cols, q8, mask=okj)
                if KEEP:
                    tl.store(rows_ptr + dj64 * stride_r + cols, v, mask=okj)
        nbad = tl.sum(bad, axis=0) * token_live.to(tl.int32)
        tl.atomic_max(flag_ptr, nbad, mask=nbad > 0)

    @triton.jit
    def _row_scales(amax_g, w, rows_ptr, HAS_W: tl.constexpr, UE8M0: tl.constexpr):
        """``(scale, row amax)`` of the gradient rows ``(g · w).to(dtype)`` (``dtype``: ``rows_ptr``'s element type)
        from ``amax_g = max |g|`` alone (shapes that broadcast; without weights the rows are ``g`` itself).

        The row's amax is ``(amax_g · |w|).to(dtype)`` bit for bit: ``|(g · w).to(dtype)|`` is the same
        two roundings (fp32 product, then the rows' dtype) of ``|g| · |w|`` (round to nearest even is
        odd-symmetric), and that map does not decrease with ``|g|``, so the largest ``|g|`` gives the
        largest ``|row|`` (ties and underflow included). A non-finite row amax means a non-finite row."""
        if HAS_W:
            ramax = (amax_g * tl.abs(w)).to(rows_ptr.dtype.element_ty).to(tl.float32)
        else:  # w holds zeros: the shape of the weighted case, amax_g's value (+0 changes no amax)
            ramax = amax_g + w
        return _scale_of(ramax, UE8M0), ramax

    @triton.jit
    def _combine_bwd_quant_kernel(grad_ptr, rows_ptr, dest_ptr, w_ptr, grad_rows_ptr, grad_w_ptr, q_ptr, s_ptr,
                                  flag_ptr, H, stride_g, stride_r, stride_gr, stride_q, stride_s, K: tl.constexpr,
                                  KP: tl.constexpr, HAS_W: tl.constexpr, NEED_GW: tl.constexpr,
                                  GROUP: tl.constexpr, UE8M0: tl.constexpr, NUM_HB: tl.constexpr,
                                  BLOCK_H: tl.constexpr, NUM_AB: tl.constexpr, BLOCK_A: tl.constexpr):
        """rows.py's combine-backward kernel (all ``k`` choices of token ``n`` as one ``[KP, BLOCK_H]`` tile,
        the same loop: equal rows, and the weight gradient's sums in the same blocks, equal up to the fp32
        rounding of the compiled sum) plus the codes and scales of each gradient row.

        The scales come from the token's ``|g|`` maxima, not from the ``k`` rows (:func:`_row_scales`):
        ``GROUP`` 0, a first pass over ``g`` alone (``BLOCK_A`` columns a step, one read of the token's
        gradient; the main loop's second read finds it in cache); 128, each block's groups of ``g``."""
        n = tl.program_id(0)
        js = tl.arange(0, KP)
        jmask = js < K
        d = tl.load(dest_ptr + n * K + js, mask=jmask, other=-1)
        live = jmask & (d >= 0)
        d64 = tl.maximum(d, 0).to(tl.int64)
        any_live = (tl.sum(live.to(tl.int32), axis=0) > 0).to(tl.int32)
        if HAS_W:
            w = tl.load(w_ptr + n * K + js, mask=jmask, other=0.0).to(tl.float32)
        else:
            w = tl.zeros([KP], dtype=tl.float32)
        grow = grad_ptr + n.to(tl.int64) * stride_g
        nbad = n * 0
        if GROUP == 0:  # the token's amax, then each choice's scale from it
            amax = tl.zeros([BLOCK_A], dtype=tl.float32)
            gbad = tl.zeros([BLOCK_A], dtype=tl.int32)
            for ab in range(NUM_AB):
                cols = ab * BLOCK_A + tl.arange(0, BLOCK_A)
                a = tl.abs(tl.load(grow + cols, mask=cols < H, other=0.0).to(tl.float32))
                amax = tl.maximum(amax, a)
                gbad += tl.where(~(a <= 3.4028234663852886e38), 1, 0)
            scale, ramax = _row_scales(tl.max(amax, axis=0), w, grad_rows_ptr, HAS_W, UE8M0)
            tl.store(s_ptr + d64 * stride_s, scale, mask=live)
            nbad = tl.sum(gbad, axis=0) * any_live + tl.sum(tl.where(live & ~(ramax <= 3.4028234663852886e38), 1, 0),
                                                            axis=0)
        dot = tl.zeros([KP], dtype=tl.float32)
        for hb in range(NUM_HB):
            cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            cmask = cols < H
            g = tl.load(grow + cols, mask=cmask, other=0.0).to(tl.float32)
            m2 = live[:, None] & cmask[None, :]
            gw = g[None, :] + tl.zeros([KP, BLOCK_H], dtype=tl.float32)
            if HAS_W:
                gw = gw * w[:, None]
            rq = gw.to(grad_rows_ptr.dtype.element_ty)
            tl.store(grad_rows_ptr + d64[:, None] * stride_gr + cols[None, :], rq, mask=m2)
            r = rq.to(tl.float32)
            if GROUP == 0:
                q = _codes(r, scale[:, None])
            else:  # the block's 1xGROUP groups of |g| (padding columns load 0), then each choice's scales
                ga = tl.abs(g)
                nbad += tl.sum(tl.where(cmask & ~(ga <= 3.4028234663852886e38), 1, 0), axis=0) * any_live
                gmax = tl.max(tl.reshape(ga, (BLOCK_H // GROUP, GROUP)), axis=1)
                sg, ramax = _row_scales(gmax[None, :], w[:, None], grad_rows_ptr, HAS_W, UE8M0)
                grp = hb * (BLOCK_H // GROUP) + tl.arange(0, BLOCK_H // GROUP)
                gmask = live[:, None] & (grp[None, :] * GROUP < H)
                nbad += tl.sum(tl.sum(tl.where(gmask & ~(ramax <= 3.4028234663852886e38), 1, 0), axis=1), axis=0)
                r3 = tl.reshape(r, (KP, BLOCK_H // GROUP, GROUP))
                q = tl.reshape(_codes(r3, sg[:, :, None]), (KP, BLOCK_H))
                tl.store(s_ptr + d64[:, None] * stride_s + grp[None, :], sg, mask=gmask)
            tl.store(q_ptr + d64[:, None] * stride_q + cols[None, :],
                     q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m2)
            if NEED_GW:
                y = tl.load(rows_ptr + d64[:, None] * stride_r + cols[None, :], mask=m2, other=0.0).to(tl.float32)
                dot += tl.sum(g[None, :] * y, axis=1)
        if NEED_GW:  # 0 for a choice landed nowhere, whatever the token's gradient (NaN · 0 is NaN)
            tl.store(grad_w_ptr + n * K + js, tl.where(live, dot, 0.0), mask=jmask)
        tl.atomic_max(flag_ptr, nbad, mask=nbad > 0)


#: Columns per block and warps of the fused kernels (a block holds whole 1x128 groups). The combine's
#: are rows.py's (its weight gradient sums the same blocks of products; on a GPU the compiled sums may round
#: differently in the last bits).
FUSED_BLOCK_H, FUSED_WARPS = 1024, 4
#: Columns a step of the combine's amax pass over a token's gradient (one scale per row): 16 bf16 a thread
#: at COMBINE_BWD_WARPS warps, two 16-byte loads.
AMAX_BLOCK_H = 2048
#: Elements of the combine's ``[k, BLOCK_H]`` tile when no weight gradient fixes its blocks (16 a thread).
COMBINE_QUANT_TILE = 2048


def _check(name: str, x: torch.Tensor, dest_Nk: torch.Tensor, group: int) -> None:
    if x.dim() != 2 or dest_Nk.dim() != 2 or dest_Nk.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: need rows [N, H] and dest [N, k] with the same N, got {tuple(x.shape)} and "
                         f"{tuple(dest_Nk.shape)}")
    if dest_Nk.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: dest must be an integer tensor, got {dest_Nk.dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: takes fp32/bf16/fp16 rows, got {x.dtype}")
    if group not in (0, 128):
        raise ValueError(f"{name}: group={group}: 0 (one scale per row) or 128 (one per row per 128 columns)")
    if group and x.shape[1] % group:
        raise ValueError(f"{name}: {x.shape[1]} columns are not a multiple of the 1x{group} scale groups")


def _live_rows(dest_Nk: torch.Tensor, num_rows_M: int) -> torch.Tensor:
    """bool ``[M]``: the rows some choice lands on."""
    d = dest_Nk.reshape(-1).to(torch.int64)
    tgt = torch.where((d >= 0) & (d < num_rows_M), d, torch.full_like(d, num_rows_M))
    return torch.zeros(num_rows_M + 1, dtype=torch.bool, device=d.device).index_fill_(0, tgt, True)[:num_rows_M]


def _scale_shape(m: int, h: int, group: int) -> tuple[int, ...]:
    return (m, h // group) if group else (m,)


def _scatter_quant_launch(x: torch.Tensor, dest: torch.Tensor, rows: torch.Tensor | None, q: torch.Tensor,
                          s: torch.Tensor, flag: torch.Tensor, group: int, ue8m0: bool) -> None:
    """The kernel over preallocated outputs (``rows`` None: codes only); writes live rows only."""
    (n, h), k, m = x.shape, dest.shape[1], q.shape[0]
    if not (n and m and k and h):
        return
    bh = min(FUSED_BLOCK_H, triton.next_power_of_2(h))
    r = rows if rows is not None else q
    _scatter_quant_kernel[(n,)](x, dest, r, q, s, flag, m, h, x.stride(0), r.stride(0), q.stride(0), s.stride(0),
                                K=k, KP=triton.next_power_of_2(k), KEEP=rows is not None, GROUP=group,
                                UE8M0=ue8m0, NUM_HB=-(-h // bh), BLOCK_H=bh, num_warps=FUSED_WARPS)


def _combine_quant_launch(g: torch.Tensor, y: torch.Tensor | None, dest: torch.Tensor, weight: torch.Tensor | None,
                          grad_y: torch.Tensor, grad_w: torch.Tensor | None, q: torch.Tensor, s: torch.Tensor,
                          flag: torch.Tensor, group: int, ue8m0: bool) -> None:
    """The kernel over preallocated outputs (``grad_w`` None: no weight gradient); writes live rows only."""
    (n, h), k = g.shape, dest.shape[1]
    if not (n and k and h):
        return
    need_gw = grad_w is not None
    y = y if need_gw else grad_y
    kp = triton.next_power_of_2(k)
    # with the weight gradient, rows.py's blocks (its dot products summed over the same blocks); without, blocks
    # of COMBINE_QUANT_TILE elements (one choice, as the a2a dispatcher's combine: 2,048 columns, not 256)
    bh = COMBINE_BWD_BLOCK_H if need_gw else max(COMBINE_BWD_BLOCK_H, COMBINE_QUANT_TILE // kp)
    bh = min(bh, triton.next_power_of_2(h))
    if group:
        bh = max(bh, group)
    ba = min(AMAX_BLOCK_H, triton.next_power_of_2(h))
    _combine_bwd_quant_kernel[(n,)](
        g, y, dest, weight if weight is not None else dest, grad_y, grad_w if need_gw else grad_y, q, s, flag, h,
        g.stride(0), y.stride(0), grad_y.stride(0), q.stride(0), s.stride(0), K=k, KP=kp,
        HAS_W=weight is not None, NEED_GW=need_gw, GROUP=group, UE8M0=ue8m0, NUM_HB=-(-h // bh), BLOCK_H=bh,
        NUM_AB=-(-h // ba), BLOCK_A=ba, num_warps=COMBINE_BWD_WARPS)


def scatter_quant_rows(x_NH: torch.Tensor, src_M: torch.Tensor, dest_Nk: torch.Tensor, group: int = 0,
                       ue8m0: bool = False, keep_rows: bool = True, check_finite: bool = True
                       ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Land ``x_NH`` in the expert-sorted buffer and quantise the landed rows in the same pass, without autograd.

    Args:
        x_NH: ``[N, H]`` fp32/bf16/fp16 source rows (the tokens, in the experts' compute dtype).
        src_M: int64 ``[M]`` source row of each landed row (``-1`` on padding).
        dest_Nk: int64 ``[N, k]`` landed row of each choice (``< 0`` or ``>= M``: not landed).
        group: 0 for one scale per row, 128 for one per row per 128 columns (``H`` a multiple of 128).
        ue8m0: power-of-two scales.
        keep_rows: also return the landed rows in ``x_NH``'s dtype (else None: nothing reads them).
        check_finite: raise (device-side) when a landed token holds NaN/Inf.
    Returns:
        ``(rows_MH or None, codes [M, H] float8_e4m3fn, scales fp32 [M] or [M, H/128])``; on a live
        row ``m``, ``rows[m] = x[src[m]]`` and codes and scales equal
        ``quant_rows(rows, layout, ue8m0, group=group)``'s bit for bit; padding rows unspecified.
    Raises:
        ValueError: shapes, dtypes or group as in :func:`~dropless.ops.fp8_quant.quant_rows`.
        RuntimeError: (asynchronously on CUDA) a landed token is not finite.
    """
    _check("scatter_quant_rows", x_NH, dest_Nk, group)
    m, (n, h) = src_M.shape[0], x_NH.shape
    if select.use_triton(x_NH):
        x = x_NH if x_NH.stride(1) == 1 else x_NH.contiguous()
        rows = x.new_empty(m, h) if keep_rows else None
        q = torch.empty(m, h, dtype=FP8_DTYPE, device=x.device)
        s = torch.empty(_scale_shape(m, h, group), dtype=torch.float32, device=x.device)
        flag = torch.zeros(1, dtype=torch.int32, device=x.device)
        _scatter_quant_launch(x, dest_Nk.contiguous(), rows, q, s, flag, group, ue8m0)
        bad = flag[0]
    else:
        d = dest_Nk.to(torch.int64)
        token_live = ((d >= 0) & (d < m)).any(1, keepdim=True)
        a = torch.where(token_live, x_NH.float(), torch.zeros((), device=x_NH.device))
        q_N, s_N, bad = _quant_torch(a, ue8m0, group)
        rows = gather_rows(x_NH, src_M) if keep_rows else None
        q = gather_rows(q_N.view(torch.uint8), src_M).view(FP8_DTYPE)
        s = gather_rows(s_N.reshape(n, h // group if group else 1), src_M)
        s = s.view(m) if group == 0 else s
    if check_finite:
        torch._assert_async(bad == 0, NONFINITE_MSG)
    return rows, q, s


def combine_bwd_quant(grad_NH: torch.Tensor, y_MH: torch.Tensor | None, dest_Nk: torch.Tensor,
                      weight_Nk: torch.Tensor | None, num_rows_M: int, need_grad_w: bool, group: int = 0,
                      ue8m0: bool = False, check_finite: bool = True):
    """:func:`~dropless.ops.rows.combine_bwd` that also quantises the gradient rows it writes.

    Args:
        As :func:`~dropless.ops.rows.combine_bwd`; ``group``, ``ue8m0``, ``check_finite`` as
        :func:`scatter_quant_rows`.
    Returns:
        ``(grad_y [M, H], grad_w [N, k] or None, codes [M, H] e4m3, scales [M] or [M, H/128])``:
        ``grad_y`` and ``grad_w`` as :func:`~dropless.ops.rows.combine_bwd`'s; on a live row the
        codes and scales equal ``quant_rows(grad_y, layout, ue8m0, group=group)``'s bit for bit;
        padding rows unspecified.
    Raises:
        ValueError: as :func:`~dropless.ops.rows.combine_bwd` and :func:`scatter_quant_rows`.
        RuntimeError: (asynchronously on CUDA) a live gradient row is not finite.
    """
    _check("combine_bwd_quant", grad_NH, dest_Nk, group)
    if need_grad_w and (weight_Nk is None or y_MH is None):
        raise ValueError("combine_bwd_quant: need_grad_w needs the weights and the combined rows y")
    (n, h), k, m = grad_NH.shape, dest_Nk.shape[1], num_rows_M
    if select.use_triton(grad_NH):
        g = grad_NH if grad_NH.stride(1) == 1 else grad_NH.contiguous()
        grad_y = g.new_empty(m, h)
        grad_w = torch.zeros(n, k, dtype=torch.float32, device=g.device) if need_grad_w else None
        q = torch.empty(m, h, dtype=FP8_DTYPE, device=g.device)
        s = torch.empty(_scale_shape(m, h, group), dtype=torch.float32, device=g.device)
        flag = torch.zeros(1, dtype=torch.int32, device=g.device)
        _combine_quant_launch(g, y_MH.contiguous() if need_grad_w else None, dest_Nk.contiguous(),
                              weight_Nk.contiguous() if weight_Nk is not None else None, grad_y, grad_w, q, s, flag,
                              group, ue8m0)
        bad = flag[0]
    else:
        grad_y, grad_w = combine_bwd_torch(grad_NH, y_MH, dest_Nk, weight_Nk, m, need_grad_w)
        live = _live_rows(dest_Nk, m).unsqueeze(1)
        q, s, bad = _quant_torch(torch.where(live, grad_y.float(), torch.zeros((), device=grad_y.device)), ue8m0,
                                 group)
    if check_finite:
        torch._assert_async(bad == 0, NONFINITE_MSG)
    return grad_y, grad_w, q, s
