"""The flat numbering of an expert layout's live tiles, for kernels whose grid does not depend on the live rows.

A kernel over the live rows of an :class:`~dropless.layout.ExpertLayout` is launched on a fixed 1-D grid
of ``G`` programs (about the GPU's resident capacity, known on the host), and each program numbers the
live tiles itself from the device-side ``start`` / ``end`` (:func:`live_tiles`, a ``cumsum`` over the
``e`` experts in registers), then takes tiles ``p, p + G, …`` (:func:`flat_unit` maps one to its rows and
columns). The work and the bytes moved follow the live rows: no program is spent on a padding row or an
empty expert, any split of the rows over the experts spreads over the whole grid, and nothing is computed
on the host or by another kernel beforehand (docs/design.md#the-live-row-contract, rule 3).

Tiles are ``BLOCK_M`` rows × ``BLOCK_N`` columns; expert ``i`` has ``ceil(count_i / BLOCK_M) · NUM_NB``
tiles, numbered ``cum[i] - nb[i] … cum[i] - 1``; its tile ``t`` covers rows
``start_i + (t // NUM_NB) · BLOCK_M …`` (below ``end_i``) and columns ``(t % NUM_NB) · BLOCK_N …``.
"""

from __future__ import annotations

from dropless.ops import select

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def live_tiles(start_ptr, end_ptr, M, E, EP: tl.constexpr, NUM_NB: tl.constexpr, BLOCK_M: tl.constexpr):
        """``(ar, nb, cum, start, end, total)``: the ``[EP]`` vectors :func:`flat_unit` takes and the number of
        live tiles (``end`` clipped to ``M``; experts ``>= E`` have none)."""
        ar = tl.arange(0, EP)
        em = ar < E
        start_v = tl.load(start_ptr + ar, mask=em, other=0)
        end_v = tl.minimum(tl.load(end_ptr + ar, mask=em, other=0), M)
        nb_v = tl.where(em, (tl.maximum(end_v - start_v, 0) + BLOCK_M - 1) // BLOCK_M, 0) * NUM_NB
        cum_v = tl.cumsum(nb_v, 0)
        return ar, nb_v, cum_v, start_v, end_v, tl.sum(nb_v, 0)

    @triton.jit
    def flat_expert(b, cum_v):
        """The expert whose tiles include tile ``b``."""
        return tl.sum((cum_v <= b).to(tl.int32), 0)

    @triton.jit
    def flat_unit(b, ar, nb_v, cum_v, start_v, end_v, NUM_NB: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
        """Tile ``b`` of the flat numbering: ``(first row, end of its expert, first column)``."""
        ex = flat_expert(b, cum_v)
        sel = ar == ex
        t = b - tl.sum(tl.where(sel, cum_v - nb_v, 0), 0)  # its number within the expert
        lo = tl.sum(tl.where(sel, start_v, 0), 0)
        hi = tl.sum(tl.where(sel, end_v, 0), 0)
        return lo + (t // NUM_NB) * BLOCK_M, hi, (t % NUM_NB) * BLOCK_N


def grid_size(capacity_tiles: int, num_experts: int, num_nb: int, programs: int) -> int:
    """Programs of a flat launch: at most ``programs`` (the GPU's share), at most one per possible tile
    (``capacity_tiles`` over the whole buffer, plus one partial row block per expert), at least one."""
    return max(1, min(capacity_tiles + num_experts * num_nb, programs))
