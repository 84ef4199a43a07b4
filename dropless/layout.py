"""The live-row expert layout (docs/design.md#the-live-row-contract).

After dispatch, the rows for a rank's ``e`` local experts lie in one buffer of
``M`` rows, grouped by local expert in ascending order, each expert's segment
starting on a multiple of the alignment ``A``::

    start[0] = 0
    start[i] = align_up(end[i-1], A)
    end[i]   = start[i] + counts[i]

Rows in the gaps ``[end[i], start[i+1])`` and in the tail ``[end[e-1], M)`` are
padding: they may hold garbage (NaN included) and no consumer reads them.
Everything here is computed on the device with no host synchronisation; the
only host-side value is the static capacity ``M``.

Source: docs/design.md#the-live-row-contract (the end-point recurrence and its example: A = 128,
counts [96, 0, 129, 1] -> start [0, 128, 128, 384], end [96, 128, 257, 385]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def align_up(x: torch.Tensor | int, a: int) -> torch.Tensor | int:
    """Round ``x`` up to a multiple of ``a`` (``a >= 1``); works on ints and int tensors."""
    return (x + (a - 1)) // a * a


def aligned_capacity(num_rows: int, num_experts: int, alignment: int) -> int:
    """Static upper bound on the aligned row count of ``num_rows`` rows over ``num_experts`` experts.

    Each of the first ``e - 1`` segments can leave a gap of at most ``A - 1``
    rows before the next one, so ``end[e-1] <= R + (e - 1)·(A - 1)``.
    """
    if num_rows < 0 or num_experts <= 0 or alignment <= 0:
        raise ValueError(
            f"aligned_capacity: need num_rows >= 0, num_experts > 0, alignment > 0; "
            f"got {num_rows}, {num_experts}, {alignment}"
        )
    return num_rows + (num_experts - 1) * (alignment - 1)


@dataclass(frozen=True)
class ExpertLayout:
    """Where each local expert's live rows lie in the landed buffer.

    Attributes:
        counts: int32 ``[e]`` live rows of each local expert (device).
        start: int32 ``[e]`` first row of each expert's segment (aligned to ``A``).
        end: int32 ``[e]`` one past the last live row (``start + counts``).
        capacity: ``M``, the static number of rows in the buffer (host int).
        alignment: ``A``.
    """

    counts: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    capacity: int
    alignment: int

    @classmethod
    def from_counts(cls, counts_e: torch.Tensor, alignment: int = 1, capacity: int | None = None,
                    num_rows: int | None = None) -> "ExpertLayout":
        """Build the layout on ``counts_e``'s device, with no host sync.

        Args:
            counts_e: integer ``[e]`` live rows per local expert.
            alignment: ``A >= 1``; each segment starts on a multiple of it.
            capacity: static ``M``. If None it is derived from ``num_rows``
                (an upper bound on ``counts_e.sum()`` known on the host) as
                :func:`aligned_capacity`.
            num_rows: host-side upper bound on the live rows (e.g. ``T·k`` for
                the local dispatcher); needed when ``capacity`` is None.
        Raises:
            ValueError: on a non-1-D or non-integer ``counts_e``, ``alignment < 1``,
                or neither capacity nor num_rows given.
        """
        if counts_e.dim() != 1 or counts_e.dtype.is_floating_point or counts_e.dtype == torch.bool:
            raise ValueError(f"ExpertLayout: counts must be a 1-D integer tensor, got "
                             f"{tuple(counts_e.shape)} {counts_e.dtype}")
        if int(alignment) < 1:
            raise ValueError(f"ExpertLayout: expert_alignment must be >= 1, got {alignment}")
        e = counts_e.numel()
        if capacity is None:
            if num_rows is None:
                raise ValueError("ExpertLayout.from_counts: give capacity (M) or num_rows (a host bound on R)")
            capacity = aligned_capacity(int(num_rows), max(e, 1), alignment)
        counts = counts_e.to(torch.int32)
        a = int(alignment)
        if a == 1:
            end = torch.cumsum(counts, 0, dtype=torch.int32)
            start = end - counts
        else:
            # start[i] = align_up(start[i-1] + c[i-1]) = start[i-1] + align_up(c[i-1]), since
            # start[i-1] is a multiple of A: starts are the exclusive prefix sum of align_up(c).
            padded = align_up(counts, a)
            start = torch.cumsum(padded, 0, dtype=torch.int32) - padded
            end = start + counts
        return cls(counts=counts, start=start.to(torch.int32), end=end.to(torch.int32),
                   capacity=int(capacity), alignment=a)

    # ------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.counts.numel()

    @property
    def device(self) -> torch.device:
        return self.counts.device

    def total_rows(self) -> torch.Tensor:
        """Rows used up to the last live row, ``end[e-1]`` (0-dim int32 device tensor; 0 if no expert)."""
        if self.num_experts == 0:
            return torch.zeros((), dtype=torch.int32, device=self.device)
        return self.end[-1]

    def row_expert(self) -> torch.Tensor:
        """int64 ``[M]``: the local expert owning each row, or -1 for a padding row."""
        if self.num_experts == 0:  # no expert: every row is padding
            return torch.full((self.capacity,), -1, dtype=torch.int64, device=self.device)
        rows = torch.arange(self.capacity, device=self.device, dtype=torch.int32)
        # the expert whose segment starts at or before the row
        idx = torch.searchsorted(self.start, rows, right=True) - 1
        # empty experts share their start with the next one; searchsorted(right) picks the last
        # expert with start <= row, which is the non-empty one when several share a start.
        idx_c = idx.clamp(min=0)
        live = (idx >= 0) & (rows < self.end[idx_c])
        return torch.where(live, idx_c, torch.full_like(idx_c, -1))

    def live_mask(self) -> torch.Tensor:
        """bool ``[M]``: True on live rows."""
        return self.row_expert() >= 0

    def check_capacity(self) -> None:
        """Raise (asynchronously on GPU, no host sync) if the live rows overflow ``M``.

        A dispatcher calls this so that a too-small capacity never drops a row silently.
        """
        torch._assert_async(
            self.total_rows() <= self.capacity,
            "dropless: the landed rows overflow the buffer capacity M; raise the capacity "
            "(or leave it None for the exact bound) -- no row is ever dropped silently",
        )

    def fill_padding_(self, buf_M: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
        """Write ``value`` into every padding row of ``buf_M`` (``[M, ...]``) in place (debug aid)."""
        mask = ~self.live_mask()
        buf_M.masked_fill_(mask.view(-1, *([1] * (buf_M.dim() - 1))), value)
        return buf_M

    def fill_padding(self, buf_M: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
        """A copy of ``buf_M`` (``[M, ...]``) with ``value`` in every padding row (out of place; debug aid)."""
        return buf_M.masked_fill(~self.live_mask().view(-1, *([1] * (buf_M.dim() - 1))), value)

    def tiles(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Tile schedule for a kernel that tiles rows by ``block_m`` (docs/design.md#failure-classes).

        Every tile lies inside one expert's live segment, so a tile never mixes
        experts even when ``A`` is not a multiple of ``block_m``.

        Returns:
            tile_expert: int32 ``[n_tiles]`` expert of each tile (-1 for unused tiles),
            tile_row: int32 ``[n_tiles]`` first row of each tile,
            n_tiles: static upper bound ``ceil(M / block_m) + e`` (host int).
        """
        e = self.num_experts
        n_tiles = -(-self.capacity // block_m) + e
        per = (self.counts + (block_m - 1)) // block_m
        cum = torch.cumsum(per, 0, dtype=torch.int32)
        t = torch.arange(n_tiles, device=self.device, dtype=torch.int32)
        ex = torch.searchsorted(cum, t, right=True)
        valid = ex < e
        ex_c = ex.clamp(max=max(e - 1, 0)).to(torch.int64)
        first = cum[ex_c] - per[ex_c]
        row = self.start[ex_c] + (t - first) * block_m
        tile_expert = torch.where(valid, ex_c.to(torch.int32), torch.full_like(t, -1))
        tile_row = torch.where(valid, row, torch.zeros_like(t))
        return tile_expert, tile_row, n_tiles


class _PoisonPadding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t_M, layout):
        ctx.layout = layout
        return layout.fill_padding(t_M)  # out of place: rule in dropless.ops.backward

    @staticmethod
    def backward(ctx, g_M):
        return ctx.layout.fill_padding(g_M), None


def poison_padding(t_M: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Debug aid (``poison_padding=True``): NaN in every padding row of ``t_M`` and of its gradient.

    It shows a leak of padding (docs/design.md#failure-classes) as NaN.

    Returns a copy of ``t_M`` (``[M, ...]``) whose padding rows are NaN; in backward the
    incoming gradient's padding rows are set to NaN too. A consumer that reads padding
    then shows NaN in its result.
    """
    return _PoisonPadding.apply(t_M, layout)
