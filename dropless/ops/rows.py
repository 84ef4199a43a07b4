"""Row movement between tokens and the landed buffer: permute (scatter), gather-sum (combine), combine backward.

Ops (each picks its Triton kernel or its torch reference in one place, :func:`dropless.ops.select.use_triton`):

* :func:`scatter_rows` — the permutation into the expert-sorted buffer:
  ``rows_MH[dest[n, j]] = x_NH[n]`` for every choice with ``0 <= dest < M``. Each source
  row is read once and written ``k`` times; padding rows are never written. Bytes:
  ``N·H + R·H`` elements (a gather by ``src_M`` would read ``R·H`` and write all ``M`` rows).
* :func:`gather_rows` — ``rows_MH[m] = x_NH[src_M[m]]`` (padding rows unspecified): the
  torch path's way to land rows (no ``k``-fold copy of ``x``).
* :func:`land_rows` — the one place that picks between the two.
* :func:`regather_rows` — a backward's re-gather (``recompute_gather``): :func:`gather_rows`
  that ``torch.compile`` keeps in the backward (an opaque op taking a tensor of the backward).
* :func:`gather_sum` — ``out[n] = Σ_j w[n, j] · rows[dest[n, j]]``, ``j = 0 … k-1`` in this
  fixed order, accumulated in fp32 (fp64 for fp64 rows), plus an optional addend row added
  to the same accumulator, rounded once: the combine's forward (with weights, and the
  shared experts' output as the addend) and the permutation's backward (without). A
  choice with ``dest < 0`` is never read (``0 · NaN = NaN``).
* :func:`combine_bwd` — for each choice ``grad_rows[dest] = w · grad_out`` (padding rows of
  ``grad_rows`` unwritten) and ``grad_w[n, j] = <grad_out[n], rows[dest[n, j]]>`` in fp32.

Indices are int64 ``dest_Nk [N, k]`` (``-1``: not landed here) and ``src_M [M]``
(``-1`` on padding). One launch each, no host sync. The Triton kernels read rows in
16-byte vectors (``H`` a multiple of 8 elements) and use 64-bit row offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dropless.ops import select

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _scatter_rows_kernel(x_ptr, dest_ptr, out_ptr, M, H, stride_x, stride_o, K: tl.constexpr,
                             NUM_HB: tl.constexpr, BLOCK_H: tl.constexpr):
        n = tl.program_id(0)
        for hb in tl.static_range(NUM_HB):
            cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            cmask = cols < H
            v = tl.load(x_ptr + n.to(tl.int64) * stride_x + cols, mask=cmask)
            for j in tl.static_range(K):
                d = tl.load(dest_ptr + n * K + j)
                # the test on a block, not the scalar: Triton's interpreter turns `block & scalar` into int32
                ok = ((cols * 0 + d) >= 0) & ((cols * 0 + d) < M)
                tl.store(out_ptr + tl.maximum(d, 0).to(tl.int64) * stride_o + cols, v, mask=cmask & ok)

    @triton.jit
    def _gather_sum_kernel(rows_ptr, dest_ptr, w_ptr, add_ptr, out_ptr, H, stride_r, stride_a, stride_o, add_row0,
                           add_rows, K: tl.constexpr, HAS_W: tl.constexpr, HAS_ADD: tl.constexpr,
                           NUM_HB: tl.constexpr, BLOCK_H: tl.constexpr):
        n = tl.program_id(0)
        for hb in tl.static_range(NUM_HB):
            cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            cmask = cols < H
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for j in tl.static_range(K):  # fixed order j = 0 … k-1
                d = tl.load(dest_ptr + n * K + j)
                live = (cols * 0 + d) >= 0  # a choice routed elsewhere: its row is never read
                r = tl.load(rows_ptr + tl.maximum(d, 0).to(tl.int64) * stride_r + cols, mask=cmask & live,
                            other=0.0).to(tl.float32)
                if HAS_W:
                    r = r * tl.load(w_ptr + n * K + j).to(tl.float32)
                acc += r
            if HAS_ADD:  # the addend's row, added to the fp32 sum before the one rounding
                a = n - add_row0
                mine = ((cols * 0 + a) >= 0) & ((cols * 0 + a) < add_rows)
                acc += tl.load(add_ptr + tl.maximum(a, 0).to(tl.int64) * stride_a + cols, mask=cmask & mine,
                               other=0.0).to(tl.float32)
            tl.store(out_ptr + n.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _combine_bwd_kernel(grad_ptr, rows_ptr, dest_ptr, w_ptr, grad_rows_ptr, grad_w_ptr, H,
                            stride_g, stride_r, stride_gr, K: tl.constexpr, KP: tl.constexpr,
                            HAS_W: tl.constexpr, NEED_GW: tl.constexpr, NUM_HB: tl.constexpr,
                            BLOCK_H: tl.constexpr):
        # all k choices of token n as one [KP, BLOCK_H] tile: grad_out is read once per column block
        n = tl.program_id(0)
        js = tl.arange(0, KP)
        jmask = js < K
        d = tl.load(dest_ptr + n * K + js, mask=jmask, other=-1)
        live = jmask & (d >= 0)
        d64 = tl.maximum(d, 0).to(tl.int64)
        if HAS_W:
            w = tl.load(w_ptr + n * K + js, mask=jmask, other=0.0).to(tl.float32)
        dot = tl.zeros([KP], dtype=tl.float32)
        for hb in tl.static_range(NUM_HB):
            cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
            cmask = cols < H
            g = tl.load(grad_ptr + n.to(tl.int64) * stride_g + cols, mask=cmask, other=0.0).to(tl.float32)
            m2 = live[:, None] & cmask[None, :]
            gw = g[None, :] + tl.zeros([KP, BLOCK_H], dtype=tl.float32)
            if HAS_W:
                gw = gw * w[:, None]
            tl.store(grad_rows_ptr + d64[:, None] * stride_gr + cols[None, :],
                     gw.to(grad_rows_ptr.dtype.element_ty), mask=m2)
            if NEED_GW:
                y = tl.load(rows_ptr + d64[:, None] * stride_r + cols[None, :], mask=m2, other=0.0).to(tl.float32)
                dot += tl.sum(g[None, :] * y, axis=1)
        if NEED_GW:  # 0 for a choice landed nowhere, whatever the token's gradient (NaN · 0 is NaN)
            tl.store(grad_w_ptr + n * K + js, tl.where(live, dot, 0.0), mask=jmask)


@dataclass
class RowSource:
    """A landed buffer given by where its rows come from, not materialised.

    ``rows_MH[m] = x_NH[src_M[m]]`` (:func:`gather_rows`); its gradient goes back to ``x_NH``
    as ``Σ_j grad_rows[dest_Nk[n, j]]``. Dispatchers that land rows by a local gather
    (``local``, ``fsdp``) can return this, so that the experts save ``x_NH`` (which the
    router keeps anyway) and re-gather in backward instead of saving ``[M, H]``
    (``recompute_gather``; docs/design.md#memory: the buffer is ``k``× the layer input).

    Attributes:
        x_NH: ``[N, H]`` source rows. src_M: int64 ``[M]`` (``-1`` on padding).
        dest_Nk: int64 ``[N, k]`` landed row of each choice (``-1``: not landed).
    """

    x_NH: torch.Tensor
    src_M: torch.Tensor
    dest_Nk: torch.Tensor


BLOCK_H, NUM_WARPS = 1024, 4
COMBINE_BWD_BLOCK_H, COMBINE_BWD_WARPS = 256, 4  # measured best at the per-rank shape (live_rows.py --sweep)


# ---------------------------------------------------------------------------- the Triton launches, as opaque ops
# (mutating their outputs, with no-op fakes) so that torch.compile traces around them with fullgraph=True;
# eager calls launch directly (the ops' dispatch costs tens of µs a call)
def _scatter_launch(x: torch.Tensor, dest: torch.Tensor, out: torch.Tensor, block_h: int, num_warps: int) -> None:
    n, k = dest.shape
    h = x.shape[1]
    bh = _block_h(h, block_h)
    _scatter_rows_kernel[(n,)](x, dest, out, out.shape[0], h, x.stride(0), out.stride(0), K=k, NUM_HB=-(-h // bh),
                               BLOCK_H=bh, num_warps=num_warps)


def _gather_sum_launch(rows: torch.Tensor, dest: torch.Tensor, weight: torch.Tensor | None,
                       addend: torch.Tensor | None, addend_row0: int, out: torch.Tensor, block_h: int,
                       num_warps: int) -> None:
    n, k = dest.shape
    h = rows.shape[1]
    bh = _block_h(h, block_h)
    add = addend if addend is not None else out
    _gather_sum_kernel[(n,)](rows, dest, weight if weight is not None else dest, add, out, h, rows.stride(0),
                             add.stride(0), out.stride(0), addend_row0, addend.shape[0] if addend is not None else 0,
                             K=k, HAS_W=weight is not None, HAS_ADD=addend is not None, NUM_HB=-(-h // bh),
                             BLOCK_H=bh, num_warps=num_warps)


def _combine_bwd_launch(grad: torch.Tensor, y: torch.Tensor | None, dest: torch.Tensor, weight: torch.Tensor | None,
                    grad_y: torch.Tensor, grad_w: torch.Tensor | None, block_h: int, num_warps: int) -> None:
    n, k = dest.shape
    h = grad.shape[1]
    bh = _block_h(h, block_h)
    need_gw = grad_w is not None
    _combine_bwd_kernel[(n,)](grad, y if need_gw else grad_y, dest, weight if weight is not None else dest, grad_y,
                              grad_w if need_gw else grad_y, h, grad.stride(0), (y if need_gw else grad_y).stride(0),
                              grad_y.stride(0), K=k, KP=triton.next_power_of_2(k), HAS_W=weight is not None,
                              NEED_GW=need_gw, NUM_HB=-(-h // bh), BLOCK_H=bh, num_warps=num_warps)


_scatter_op = torch.library.custom_op("dropless::scatter_rows", _scatter_launch, mutates_args=("out",))
_gather_sum_op = torch.library.custom_op("dropless::gather_sum", _gather_sum_launch, mutates_args=("out",))
_combine_bwd_op = torch.library.custom_op("dropless::combine_bwd", _combine_bwd_launch,
                                          mutates_args=("grad_y", "grad_w"))
for _op in (_scatter_op, _gather_sum_op, _combine_bwd_op):
    _op.register_fake(lambda *args: None)


def _check_rows(name: str, what: str, t: torch.Tensor, kernel: bool) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name}: {what} must be 2-D [rows, H], got {tuple(t.shape)}")
    if kernel and t.stride(1) != 1:
        raise ValueError(f"{name}: {what}'s columns must be contiguous (stride(1) == 1), got strides "
                         f"{t.stride()}; call .contiguous() first")


def _check_dest(name: str, dest_Nk: torch.Tensor, n: int | None = None) -> None:
    bad_n = n is not None and dest_Nk.shape[0] != n
    if dest_Nk.dim() != 2 or dest_Nk.dtype not in (torch.int64, torch.int32) or bad_n:
        raise ValueError(f"{name}: dest must be an integer [N, k] tensor{'' if n is None else f' with N = {n}'}, "
                         f"got {tuple(dest_Nk.shape)} {dest_Nk.dtype}")


def _block_h(h: int, cap: int) -> int:
    return min(cap, triton.next_power_of_2(max(h, 1)))


# ---------------------------------------------------------------------------- torch references
def scatter_rows_torch(x_NH: torch.Tensor, dest_Nk: torch.Tensor, num_rows_M: int) -> torch.Tensor:
    """Reference of :func:`scatter_rows` (one scratch row takes the choices not landed here)."""
    out = x_NH.new_empty(num_rows_M + 1, x_NH.shape[1])
    for j in range(dest_Nk.shape[1]):
        d = dest_Nk[:, j].to(torch.int64)
        out.index_copy_(0, torch.where((d >= 0) & (d < num_rows_M), d, torch.full_like(d, num_rows_M)), x_NH)
    return out[:num_rows_M]


def gather_sum_torch(rows_MH: torch.Tensor, dest_Nk: torch.Tensor, weight_Nk: torch.Tensor | None,
                     addend_AH: torch.Tensor | None = None, addend_row0: int = 0) -> torch.Tensor:
    """Reference of :func:`gather_sum`: the same fixed ``j`` order, fp32 (fp64) accumulator, the addend last."""
    n, k = dest_Nk.shape
    acc_dt = torch.promote_types(rows_MH.dtype, torch.float32)
    acc = torch.zeros(n, rows_MH.shape[1], dtype=acc_dt, device=rows_MH.device)
    for j in range(k):
        idx = dest_Nk[:, j]
        live = (idx >= 0).unsqueeze(1)
        r = rows_MH.index_select(0, idx.clamp(min=0)).to(acc_dt)
        if weight_Nk is not None:
            r = r * weight_Nk[:, j : j + 1].to(acc_dt)
        # out of place, and no no-op .to(): it is a custom Function's output (rule in dropless.ops.backward)
        acc = acc + torch.where(live, r, torch.zeros((), device=r.device))
    if addend_AH is not None:
        lo, hi = addend_row0, addend_row0 + addend_AH.shape[0]
        acc = torch.cat([acc[:lo], acc[lo:hi] + addend_AH.to(acc_dt), acc[hi:]]) if (lo, hi) != (0, n) \
            else acc + addend_AH.to(acc_dt)
    return acc if acc.dtype == rows_MH.dtype else acc.to(rows_MH.dtype)


def combine_bwd_torch(grad_NH: torch.Tensor, y_MH: torch.Tensor | None, dest_Nk: torch.Tensor,
                      weight_Nk: torch.Tensor | None, num_rows_M: int, need_grad_w: bool):
    """Reference of :func:`combine_bwd` (fp32 products, fp64 for fp64)."""
    n, k = dest_Nk.shape
    acc_dt = torch.promote_types(grad_NH.dtype, torch.float32)
    g32 = grad_NH.to(acc_dt)
    m = num_rows_M
    grad_ext = grad_NH.new_empty(m + 1, grad_NH.shape[1])  # row M takes the choices not landed here
    for j in range(k):
        idx = dest_Nk[:, j]
        tgt = torch.where(idx >= 0, idx, torch.full_like(idx, m))
        src = grad_NH if weight_Nk is None else (g32 * weight_Nk[:, j : j + 1].to(acc_dt)).to(grad_NH.dtype)
        grad_ext.index_copy_(0, tgt, src)
    grad_w = None
    if need_grad_w:
        cols = []
        for j in range(k):
            idx = dest_Nk[:, j]
            yj = y_MH.index_select(0, idx.clamp(min=0)).to(acc_dt)
            dot = (g32 * yj).sum(-1)
            cols.append(torch.where(idx >= 0, dot, torch.zeros_like(dot)))
        grad_w = torch.stack(cols, 1)
    return grad_ext[:m], grad_w


# ---------------------------------------------------------------------------- the ops
def scatter_rows(x_NH: torch.Tensor, dest_Nk: torch.Tensor, num_rows_M: int) -> torch.Tensor:
    """Land ``x_NH`` in the expert-sorted buffer: ``rows_MH[dest[n, j]] = x_NH[n]``, without autograd.

    Args:
        x_NH: ``[N, H]`` source rows (columns contiguous on the Triton path).
        dest_Nk: int64 ``[N, k]`` landed row of each choice; ``< 0`` or ``>= M``: not landed.
        num_rows_M: ``M``, rows of the buffer.
    Returns:
        ``[M, H]`` in ``x_NH``'s dtype; rows no choice names (padding) are left unwritten.
    Raises:
        ValueError: a non-2-D ``x``, a ``dest`` of the wrong shape or dtype, strided columns.
    """
    kernel = select.use_triton(x_NH) and x_NH.dtype != torch.float64
    _check_rows("scatter_rows", "x", x_NH, kernel)
    _check_dest("scatter_rows", dest_Nk, x_NH.shape[0])
    if not kernel:
        return scatter_rows_torch(x_NH, dest_Nk, num_rows_M)
    n, k = dest_Nk.shape
    h = x_NH.shape[1]
    out = x_NH.new_empty(num_rows_M, h)
    if n == 0 or num_rows_M == 0 or k == 0:
        return out
    launch = _scatter_op if torch.compiler.is_compiling() else _scatter_launch
    launch(x_NH, dest_Nk.contiguous(), out, BLOCK_H, NUM_WARPS)
    return out


def land_rows(x_NH: torch.Tensor, src_M: torch.Tensor, dest_Nk: torch.Tensor) -> torch.Tensor:
    """The landed buffer ``rows_MH [M = len(src_M), H]`` of ``x_NH``, without autograd.

    Triton path: :func:`scatter_rows` by ``dest_Nk`` (each source row read once, padding rows
    unwritten). Torch path: :func:`gather_rows` by ``src_M`` (padding rows get row 0).
    Either way the live rows are ``x_NH[src_M[m]]`` exactly.
    """
    if select.use_triton(x_NH) and x_NH.dtype != torch.float64 and x_NH.stride(1) == 1:
        return scatter_rows(x_NH, dest_Nk, src_M.shape[0])
    return gather_rows(x_NH, src_M)


def gather_rows(x_NH: torch.Tensor, src_M: torch.Tensor) -> torch.Tensor:
    """``rows_MH[m] = x_NH[src_M[m]]`` without autograd; padding rows (``src = -1``) unspecified."""
    if x_NH.shape[0] == 0:  # a rank that received no rows: every landed row is padding
        return x_NH.new_empty(src_M.shape[0], x_NH.shape[1])
    # padding rows read row 0: garbage by contract, never used
    return x_NH.index_select(0, src_M.clamp(min=0))


def _regather_rows(x_NH: torch.Tensor, src_M: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    return gather_rows(x_NH, src_M)


_regather_op = torch.library.custom_op("dropless::regather_rows", _regather_rows, mutates_args=())
_regather_op.register_fake(lambda x_NH, src_M, after: x_NH.new_empty(src_M.shape[0], x_NH.shape[1]))


def regather_rows(x_NH: torch.Tensor, src_M: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A backward pass's re-gather of the landed rows: :func:`gather_rows`, ordered after ``after``.

    ``after`` is any tensor the backward pass computed (e.g. the incoming gradient); it is not
    read. While ``torch.compile`` traces (an opaque op, ``dropless::regather_rows``) it makes the
    gather depend on the backward: a gather whose inputs are all forward values is a forward
    node to the partitioner, and inductor's min-cut partitioner, seeing a matmul consume it in
    backward, bans recomputing it and so computes it in the forward and saves its ``[M, H]``
    output (``recompute_gather`` then saves nothing). Being another op than the forward's gather,
    it is not merged with it by the common-subexpression pass either. Eagerly it is
    :func:`gather_rows`.
    """
    if torch.compiler.is_compiling():
        return _regather_op(x_NH, src_M, after)
    return gather_rows(x_NH, src_M)


def gather_sum(rows_MH: torch.Tensor, dest_Nk: torch.Tensor, weight_Nk: torch.Tensor | None,
               addend_AH: torch.Tensor | None = None, addend_row0: int = 0) -> torch.Tensor:
    """``out[n] = Σ_j w[n, j] · rows[dest[n, j]] (+ addend[n - row0])`` in fp32 (fp64 for fp64 rows), rounded once.

    The sum runs over ``j = 0 … k-1`` in this fixed order, then the addend's row (if any) is
    added to the same fp32 accumulator, and the result is rounded to ``rows_MH``'s dtype once
    (the MoE layer's shared-expert output joins the routed combine here, so a bf16 output is
    not rounded twice). The addend costs one read of its rows, no extra pass.

    Args:
        rows_MH: ``[M, H]``; only rows named by ``dest_Nk`` are read.
        dest_Nk: int64 ``[N, k]``; a choice with ``dest < 0`` contributes nothing and its
            row is not read (a masked load, since ``0 · NaN = NaN``).
        weight_Nk: ``[N, k]`` weights (any float dtype), or None for a plain sum.
        addend_AH: ``[A, H]`` (any float dtype; columns contiguous on the Triton path) added to
            output rows ``addend_row0 … addend_row0 + A - 1``, or None.
        addend_row0: first output row the addend covers (``0 <= row0``, ``row0 + A <= N``).
    Returns:
        ``[N, H]`` in ``rows_MH``'s dtype.
    Raises:
        ValueError: wrong shapes or dtypes, strided columns on the Triton path, an addend
            outside the output rows.
    """
    kernel = select.use_triton(rows_MH) and rows_MH.dtype != torch.float64
    _check_rows("gather_sum", "rows", rows_MH, kernel)
    _check_dest("gather_sum", dest_Nk)
    if weight_Nk is not None and tuple(weight_Nk.shape) != tuple(dest_Nk.shape):
        raise ValueError(f"gather_sum: weight must be {list(dest_Nk.shape)} like dest, got {list(weight_Nk.shape)}")
    n, k = dest_Nk.shape
    h = rows_MH.shape[1]
    if addend_AH is not None:
        _check_rows("gather_sum", "addend", addend_AH, kernel)
        if (addend_AH.shape[1] != h or not addend_AH.dtype.is_floating_point or addend_row0 < 0
                or addend_row0 + addend_AH.shape[0] > n):
            raise ValueError(f"gather_sum: addend must be a float [A, H={h}] tensor over output rows "
                             f"row0 … row0 + A - 1 within [0, N={n}); got {tuple(addend_AH.shape)} "
                             f"{addend_AH.dtype} at row0={addend_row0}")
    if not kernel:
        return gather_sum_torch(rows_MH, dest_Nk, weight_Nk, addend_AH, addend_row0)
    if k == 0:  # nothing to gather: zeros plus the addend
        return gather_sum_torch(rows_MH, dest_Nk, weight_Nk, addend_AH, addend_row0)
    out = rows_MH.new_empty(n, h)
    if n == 0:
        return out
    launch = _gather_sum_op if torch.compiler.is_compiling() else _gather_sum_launch
    launch(rows_MH, dest_Nk.contiguous(), weight_Nk.contiguous() if weight_Nk is not None else None, addend_AH,
           addend_row0, out, BLOCK_H, NUM_WARPS)
    return out


def combine_bwd(grad_NH: torch.Tensor, y_MH: torch.Tensor | None, dest_Nk: torch.Tensor,
                weight_Nk: torch.Tensor | None, num_rows_M: int, need_grad_w: bool):
    """Backward of the weighted combine ``out[n] = Σ_j w[n, j] · y[dest[n, j]]``.

    Args:
        grad_NH: ``[N, H]`` gradient of the combined output.
        y_MH: ``[M, H]`` the rows combined (needed only for ``need_grad_w``).
        dest_Nk: int64 ``[N, k]`` (``-1``: not landed here). weight_Nk: ``[N, k]`` or None (all 1).
        num_rows_M: ``M``. need_grad_w: also return the weights' gradient.
    Returns:
        ``(grad_y [M, H]`` in ``grad``'s dtype (padding rows unwritten),
        ``grad_w [N, k]`` fp32 (fp64 for fp64; 0 where ``dest < 0``) or None).
    """
    kernel = select.use_triton(grad_NH) and grad_NH.dtype != torch.float64
    _check_rows("combine_bwd", "grad", grad_NH, kernel)
    _check_dest("combine_bwd", dest_Nk, grad_NH.shape[0])
    if need_grad_w and (weight_Nk is None or y_MH is None):
        raise ValueError("combine_bwd: need_grad_w needs the weights and the combined rows y")
    if not kernel:
        return combine_bwd_torch(grad_NH, y_MH, dest_Nk, weight_Nk, num_rows_M, need_grad_w)
    n, k = dest_Nk.shape
    h = grad_NH.shape[1]
    grad_y = grad_NH.new_empty(num_rows_M, h)
    grad_w = torch.zeros(n, k, dtype=torch.float32, device=grad_NH.device) if need_grad_w else None
    if n == 0 or k == 0:
        return grad_y, grad_w
    if need_grad_w:
        _check_rows("combine_bwd", "y", y_MH, kernel)
    launch = _combine_bwd_op if torch.compiler.is_compiling() else _combine_bwd_launch
    launch(grad_NH, y_MH if need_grad_w else None, dest_Nk.contiguous(),
           weight_Nk.contiguous() if weight_Nk is not None else None, grad_y, grad_w, COMBINE_BWD_BLOCK_H,
           COMBINE_BWD_WARPS)
    return grad_y, grad_w
