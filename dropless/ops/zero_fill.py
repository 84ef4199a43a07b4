"""Exact zeros where the grouped weight gradient needs them: alignment-gap rows, empty experts' ``dW``.

* :func:`zero_gap_rows_` — zeros into the gaps ``[end[i], start[i+1])`` of a landed buffer
  (at most ``(e-1)·(A-1)`` padding rows), so that a grouped weight-gradient GEMM over the
  unaligned ends ``[end[i-1], end[i])`` adds exact zeros for them instead of what they held.
* :func:`zero_empty_experts_` — exact zeros into ``dW[i]`` of every expert with
  ``counts[i] == 0`` (empty experts, docs/design.md#failure-classes: some grouped GEMMs leave garbage for empty groups).

Both write in place, touch nothing else, and pick the Triton kernel or the torch
reference in one place (:func:`dropless.ops.select.use_triton`). No host sync.
"""

from __future__ import annotations

import torch

from dropless.layout import ExpertLayout
from dropless.ops import select

if select.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _zero_empty_experts_kernel(dw_ptr, counts_ptr, numel_per_expert, BLOCK: tl.constexpr):
        ex = tl.program_id(0)
        if tl.load(counts_ptr + ex) > 0:  # a non-empty expert's programs exit at once
            return
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dw_ptr + ex.to(tl.int64) * numel_per_expert + idx,
                 tl.zeros([BLOCK], dtype=dw_ptr.dtype.element_ty), mask=idx < numel_per_expert)

    @triton.jit
    def _zero_gap_rows_kernel(buf_ptr, start_ptr, end_ptr, K, stride, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        i = tl.program_id(0)  # the gap after expert i: [end[i], start[i+1]), shorter than A
        gap0 = tl.load(end_ptr + i)
        gap1 = tl.load(start_ptr + i + 1)
        rows = gap0 + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < gap1) & (cols[None, :] < K)
        tl.store(buf_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :],
                 tl.zeros([BLOCK_M, BLOCK_K], dtype=buf_ptr.dtype.element_ty), mask=mask)


# the Triton launches as opaque in-place ops (no-op fakes), so that torch.compile traces around them;
# eager calls launch directly
def _zero_gap_rows_launch(buf: torch.Tensor, start: torch.Tensor, end: torch.Tensor, alignment: int) -> None:
    k = buf.shape[1]
    bm, bk = 32, 256
    grid = (start.numel() - 1, triton.cdiv(alignment - 1, bm), triton.cdiv(k, bk))
    _zero_gap_rows_kernel[grid](buf, start, end, k, buf.stride(0), BLOCK_M=bm, BLOCK_K=bk)


def _zero_empty_experts_launch(dw: torch.Tensor, counts: torch.Tensor) -> None:
    n = dw[0].numel()
    _zero_empty_experts_kernel[(dw.shape[0], triton.cdiv(n, 8192))](dw, counts, n, BLOCK=8192)


_zero_gap_rows_op = torch.library.custom_op("dropless::zero_gap_rows_", _zero_gap_rows_launch,
                                            mutates_args=("buf",))
_zero_empty_experts_op = torch.library.custom_op("dropless::zero_empty_experts_", _zero_empty_experts_launch,
                                                 mutates_args=("dw",))
for _op in (_zero_gap_rows_op, _zero_empty_experts_op):
    _op.register_fake(lambda *args: None)


def zero_gap_rows_(buf_MK: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Write zeros into the alignment gaps ``[end[i], start[i+1])`` of ``buf_MK`` (``[M, K]``), in place.

    Only gap rows are written (not live rows, not the tail after ``end[e-1]``). Raises
    ValueError when ``buf_MK`` is not ``[M, K]`` with contiguous columns (Triton path).
    """
    e = layout.num_experts
    if buf_MK.dim() != 2 or buf_MK.shape[0] != layout.capacity:
        raise ValueError(f"zero_gap_rows_: need the [M={layout.capacity}, K] buffer, got {tuple(buf_MK.shape)}")
    if e < 2 or layout.alignment == 1:
        return buf_MK
    if not select.use_triton(buf_MK):
        rows = torch.arange(layout.capacity, device=buf_MK.device)
        gap = ((rows[:, None] >= layout.end[:-1]) & (rows[:, None] < layout.start[1:])).any(1)
        return buf_MK.masked_fill_(gap.unsqueeze(1), 0)
    if buf_MK.stride(1) != 1:
        raise ValueError(f"zero_gap_rows_: columns must be contiguous, got strides {buf_MK.stride()}")
    launch = _zero_gap_rows_op if torch.compiler.is_compiling() else _zero_gap_rows_launch
    launch(buf_MK, layout.start, layout.end, layout.alignment)
    return buf_MK


def zero_empty_experts_(dw_eKN: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
    """Write exact zeros into ``dw[i]`` (``[e, K, N]``, contiguous) for every ``counts[i] == 0``, in place.

    Only the empty experts' slices are touched (on the Triton path the programs of a
    non-empty expert exit at once, unlike a ``torch.where`` over the whole gradient).
    Raises ValueError on a non-contiguous ``dw`` or a ``counts`` that is not ``[e]``.
    """
    e = dw_eKN.shape[0]
    if counts_e.shape != (e,):
        raise ValueError(f"zero_empty_experts_: counts must be [{e}], got {list(counts_e.shape)}")
    if not dw_eKN.is_contiguous():
        raise ValueError("zero_empty_experts_: dw must be contiguous")
    if not select.use_triton(dw_eKN):
        return dw_eKN.masked_fill_((counts_e == 0).view(e, *([1] * (dw_eKN.dim() - 1))), 0)
    n = dw_eKN[0].numel() if e else 0
    if e == 0 or n == 0:
        return dw_eKN
    launch = _zero_empty_experts_op if torch.compiler.is_compiling() else _zero_empty_experts_launch
    launch(dw_eKN, counts_e)
    return dw_eKN
