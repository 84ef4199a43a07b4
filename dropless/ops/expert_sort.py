"""Where each routed choice lands in the expert-sorted, aligned buffer: the live-row layout of a dispatch.

One op, :func:`sort_by_expert`, which picks its Triton kernels or its torch reference in one place
(:func:`dropless.ops.select.use_triton`). For ``N`` rows with ``k`` choices each (``expert_idx_Nk``)
and ``e`` experts it gives the :class:`~dropless.layout.ExpertLayout` (``counts``, ``start``,
``end``), the landed row of every choice (``dest_Nk``) and the source row of every landed row
(``src_M``). The order is a stable sort by expert of the flattened choices ``n·k + j``: within an
expert's segment, rows follow their flat index. That is the order the combine's sum and every
dispatcher's tests rely on, and both paths give it exactly (integers only, nothing rounds).

The Triton path is three launches and no host sync. It replaces the reference's sort, binary
search, prefix sums and scatters, about forty small operators whose host-side launch cost, not their GPU
time, kept the GPU waiting in an eager step
(``benchmarks/results/host_timeline_h200_2026-12-03.json``):

1. ``_hist_kernel``: each program counts the choices of its ``BLOCK`` consecutive flat entries per
   expert, ``hist[i, b]``;
2. ``_scan_kernel``, one program per expert: the exclusive prefix of ``hist[i]`` over the blocks
   (``offs[i, b]``, the rows of expert ``i`` in earlier blocks) and ``counts[i]``;
3. ``_dest_kernel``: each program derives ``start = exclusive prefix of align_up(counts, A)`` (the
   first also writes ``start``, ``end = start + counts`` and whether ``end[e-1] <= M``), ranks its
   entries within their expert by a cumulative sum of the ``[BLOCK, e]`` one-hot, and writes
   ``dest = start[i] + offs[i, b] + rank`` and ``src[dest] = n``.

``BLOCK`` is ``4096 / e`` with ``e`` padded to a power of two and at most 256 (16 from 256 experts
on): a program holds a ``[BLOCK, e]`` one-hot. The two histograms take ``2·e·⌈N·k / BLOCK⌉`` int32,
``N·k·e² / 512`` bytes: 1.5 MiB at ``recipe=h200_single`` (196,608 choices over 64 experts), 8 MiB
at DeepSeek-V3's 65,536 choices over 256. With more than :data:`MAX_KERNEL_EXPERTS` padded experts,
a histogram past int32 indexing, or while ``torch.compile`` traces (inductor fuses the reference's
operators itself), the reference runs.
"""

from __future__ import annotations

import torch

from dropless.layout import ExpertLayout, aligned_capacity
from dropless.ops import select

__all__ = ["sort_by_expert", "sort_by_expert_torch", "MAX_KERNEL_EXPERTS"]

#: padded experts above this take the torch reference (DeepSeek-V3's 256; the histograms grow as e²)
MAX_KERNEL_EXPERTS = 256
#: entries of a program's ``[BLOCK, e]`` one-hot (``BLOCK`` at least 16)
_ONE_HOT_ELEMS = 4096
_OVERFLOW = ("dropless: the landed rows overflow the buffer capacity M; raise the capacity "
             "(or leave it None for the exact bound) -- no row is ever dropped silently")

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _one_hot(idx_ptr, pid, n, E, EP: tl.constexpr, BLOCK: tl.constexpr):
        """The block's flat offsets, its in-range mask, expert ids (int32; 0 where not here) and one-hot."""
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n
        e = tl.load(idx_ptr + offs, mask=inb, other=-1)
        here = inb & (e >= 0) & (e < E)
        ec = tl.where(here, e, 0).to(tl.int32)
        ids = tl.arange(0, EP)
        hit = (ec[:, None] == ids[None, :]) & here[:, None]
        return offs, inb, here, ec, hit

    @triton.jit
    def _hist_kernel(idx_ptr, hist_ptr, n, nblocks, E, EP: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        _, _, _, _, hit = _one_hot(idx_ptr, pid, n, E, EP, BLOCK)
        tl.store(hist_ptr + tl.arange(0, EP) * nblocks + pid, tl.sum(hit.to(tl.int32), axis=0))

    @triton.jit
    def _scan_kernel(hist_ptr, offs_ptr, counts_ptr, nblocks, RB: tl.constexpr):
        i = tl.program_id(0)  # one expert
        carry = tl.zeros([], tl.int32)
        for b0 in range(0, nblocks, RB):
            rows = b0 + tl.arange(0, RB)
            m = rows < nblocks
            h = tl.load(hist_ptr + i * nblocks + rows, mask=m, other=0)
            tl.store(offs_ptr + i * nblocks + rows, tl.cumsum(h, axis=0) - h + carry, mask=m)
            carry += tl.sum(h, axis=0)
        tl.store(counts_ptr + i, carry)

    @triton.jit
    def _dest_kernel(idx_ptr, offs_ptr, meta_ptr, ok_ptr, dest_ptr, src_ptr, n, nblocks, E, K, capacity, A,
                     EP: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        ids = tl.arange(0, EP)
        real = ids < E
        counts = tl.load(meta_ptr + ids, mask=real, other=0)
        padded = (counts + (A - 1)) // A * A
        start = tl.cumsum(padded, axis=0) - padded
        if pid == 0:
            end = start + counts
            tl.store(meta_ptr + E + ids, start, mask=real)
            tl.store(meta_ptr + 2 * E + ids, end, mask=real)
            # ends never decrease, so the largest is end[e-1]
            tl.store(ok_ptr, (tl.max(tl.where(real, end, 0), axis=0) <= capacity).to(tl.int8))
        offs, inb, here, ec, hit = _one_hot(idx_ptr, pid, n, E, EP, BLOCK)
        # each entry's expert start and rank within the block, picked from the [BLOCK, e] one-hot
        first = tl.sum(tl.where(hit, start[None, :] + tl.cumsum(hit.to(tl.int32), axis=0), 0), axis=1) - 1
        before = tl.load(offs_ptr + ec * nblocks + pid, mask=here, other=0)  # rows of its expert in earlier blocks
        dest = tl.where(here, (first + before).to(tl.int64), -1)
        tl.store(dest_ptr + offs, dest, mask=inb)
        tl.store(src_ptr + dest, (offs // K).to(tl.int64), mask=here & (dest < capacity))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def kernel_block(num_experts: int) -> int:
    """Flat entries per program of the kernels (a ``[BLOCK, e]`` one-hot of :data:`_ONE_HOT_ELEMS`)."""
    return max(16, _ONE_HOT_ELEMS // _pow2(num_experts))


def _sort_by_expert_triton(flat: torch.Tensor, n: int, k: int, e: int, alignment: int, capacity: int):
    dev = flat.device
    ep, block = _pow2(e), kernel_block(e)
    nblocks = triton.cdiv(n * k, block)
    hist = torch.empty(2, ep, nblocks, dtype=torch.int32, device=dev)  # [0]: per block, [1]: its prefix
    meta = torch.empty(3, e, dtype=torch.int32, device=dev)            # counts, start, end
    ok = torch.empty((), dtype=torch.int8, device=dev)
    dest = torch.empty(n * k, dtype=torch.int64, device=dev)
    src = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
    if nblocks:
        _hist_kernel[(nblocks,)](flat, hist[0], n * k, nblocks, e, EP=ep, BLOCK=block, num_warps=4)
    _scan_kernel[(e,)](hist[0], hist[1], meta, nblocks, RB=1024, num_warps=4)
    # max(k, 1): with k = 0 every lane is masked, but the interpreter still divides by K
    _dest_kernel[(max(nblocks, 1),)](flat, hist[1], meta, ok, dest, src, n * k, nblocks, e, max(k, 1), capacity,
                                     alignment, EP=ep, BLOCK=block, num_warps=4)
    torch._assert_async(ok, _OVERFLOW)
    counts, start, end = meta.unbind(0)
    return ExpertLayout(counts=counts, start=start, end=end, capacity=capacity, alignment=alignment), dest, src


def sort_by_expert_torch(expert_idx_Nk: torch.Tensor, num_experts: int, alignment: int, capacity: int
                         ) -> tuple[ExpertLayout, torch.Tensor, torch.Tensor]:
    """Reference of :func:`sort_by_expert` (``capacity`` given): a stable ``torch.sort`` of the keys."""
    n, k = expert_idx_Nk.shape
    dev = expert_idx_Nk.device
    flat = expert_idx_Nk.reshape(-1).to(torch.int64)
    here = (flat >= 0) & (flat < num_experts)
    # not-routed choices sort after every real expert (key = num_experts)
    key = torch.where(here, flat, torch.full_like(flat, num_experts))
    # one stable sort gives the order and, by binary search of its keys, the counts: no atomic
    # histogram (an int64 scatter_add of N·k ones into e + 1 bins serialises on the bins)
    key_sorted, order = torch.sort(key, stable=True)
    bounds = torch.searchsorted(key_sorted, torch.arange(num_experts + 2, device=dev, dtype=key.dtype))
    first_sorted = bounds[:-1]  # first sorted position of each key
    counts = (bounds[1:] - first_sorted)[:num_experts]
    layout = ExpertLayout.from_counts(counts, alignment, capacity=capacity)
    layout.check_capacity()  # never drop a row silently, whatever the bound (async on GPU, no sync)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=dev)
    key_c = key.clamp(max=max(num_experts - 1, 0))
    dest = layout.start.to(torch.int64)[key_c] + (pos - first_sorted[key])
    dest = torch.where(here, dest, torch.full_like(dest, -1))
    src = torch.full((layout.capacity + 1,), -1, dtype=torch.int64, device=dev)
    # not-routed choices write into the extra slot M, which is cut off below
    src.scatter_(0, torch.where(here & (dest < layout.capacity), dest, torch.full_like(dest, layout.capacity)),
                 torch.arange(n * k, device=dev) // k)
    return layout, dest.view(n, k), src[: layout.capacity]


def sort_by_expert(expert_idx_Nk: torch.Tensor, num_experts: int, alignment: int = 1,
                   capacity: int | None = None, num_rows: int | None = None
                   ) -> tuple[ExpertLayout, torch.Tensor, torch.Tensor]:
    """Where each (row, choice) lands in an expert-sorted, aligned buffer. No host sync.

    Args:
        expert_idx_Nk: integer ``[N, k]`` expert of each choice, in ``[0, num_experts)``;
            a value ``< 0`` or ``>= num_experts`` means "not routed here" (dropped
            from this buffer, e.g. another rank's expert).
        num_experts: ``e``, experts in the buffer.
        alignment: ``A >= 1``.
        capacity: static ``M``; default the exact bound for ``N·k`` rows
            (:func:`dropless.layout.aligned_capacity`).
        num_rows: host bound on the rows routed here (defaults to ``N·k``).
    Returns:
        layout: the :class:`ExpertLayout` (int32 ``counts``, ``start``, ``end``).
        dest_Nk: int64 ``[N, k]`` landed row of each choice; ``-1`` where not routed here.
        src_M: int64 ``[M]`` source row of each landed row; ``-1`` on padding rows.
    Raises:
        ValueError: ``expert_idx_Nk`` not a 2-D integer tensor, ``alignment < 1``, ``num_experts < 1``,
            a negative ``capacity``.
        RuntimeError: the live rows overflow ``M`` (``torch._assert_async``: at once on the CPU, a
            device-side assert on the GPU); no row is dropped silently.
    """
    dt = expert_idx_Nk.dtype
    if expert_idx_Nk.dim() != 2 or dt.is_floating_point or dt.is_complex or dt == torch.bool:
        raise ValueError(f"sort_by_expert: expert_idx_Nk must be a 2-D integer tensor [N, k], got "
                         f"{tuple(expert_idx_Nk.shape)} {dt}")
    if int(alignment) < 1:
        raise ValueError(f"sort_by_expert: expert_alignment must be >= 1, got {alignment}")
    if int(num_experts) < 1:
        raise ValueError(f"sort_by_expert: num_experts must be >= 1 (the experts in the buffer), got {num_experts}")
    n, k = expert_idx_Nk.shape
    if capacity is None:
        capacity = aligned_capacity(n * k if num_rows is None else int(num_rows), num_experts, alignment)
    capacity, alignment, num_experts = int(capacity), int(alignment), int(num_experts)
    if capacity < 0:
        raise ValueError(f"sort_by_expert: capacity must be >= 0 rows, got {capacity}")
    ep = _pow2(num_experts)
    kernel = (select.use_triton(expert_idx_Nk) and not torch.compiler.is_compiling() and ep <= MAX_KERNEL_EXPERTS
              # int32 counts and positions, and int32 indices into the [e, blocks] histograms
              and n * k + num_experts * alignment + capacity < 2**31
              and ep * (-(-n * k // kernel_block(num_experts))) < 2**31)
    if not kernel:
        return sort_by_expert_torch(expert_idx_Nk, num_experts, alignment, capacity)
    flat = expert_idx_Nk.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    layout, dest, src = _sort_by_expert_triton(flat, n, k, num_experts, alignment, capacity)
    return layout, dest.view(n, k), src
