"""The ``torch`` grouped GEMM backend: ``torch.nn.functional.grouped_mm``.

Forward uses the layout's unaligned ends as the group offsets: group ``i``
spans ``[end[i-1], end[i])``, i.e. the gap before expert ``i`` plus its live
rows, so gap rows produce garbage only in gap rows of the output.

The weight gradient must not see padding rows (a NaN there would poison
``dw``; docs/design.md#the-live-row-contract, rule 2). With ``A = 1`` there are no gaps and the ends are the
offsets. With ``A > 1`` the gap rows ``[end[i], start[i+1])`` of both operands
are first overwritten with zeros (they are padding; :mod:`dropless.ops.zero_fill`),
so the groups ``[end[i-1], end[i])`` add exact zeros for them. An empty expert
is forced to an exact zero (empty experts, docs/design.md#failure-classes: some GPU kernels leave garbage for empty
groups). On CUDA, when one expert's weight-gradient tiles are fewer than the SMs,
the weight gradient runs :func:`dropless.ops.triton_wgrad.grouped_wgrad` instead
(largest experts first, live rows only; :func:`wgrad_by_triton` says why).

Limits (torch 2.11–2.13): on CPU fp32/bf16/fp16 operands; on CUDA bf16 on
sm90+; every row stride a multiple of 16 bytes (K and N multiples of 8 for
bf16, 4 for fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dropless.layout import ExpertLayout
from dropless.ops import select
from dropless.ops.zero_fill import zero_empty_experts_, zero_gap_rows_

if select.HAS_TRITON:
    from dropless.ops import triton_wgrad


def _grouped_mm_eager(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``grouped_mm(a, b, offs)``; as ``dropless::grouped_mm`` an opaque op for ``torch.compile``:
    torch's meta function for it assumes CUDA bf16, so the CPU fp32 call could not be traced; this
    op's fake gives the shape for any dtype."""
    fn = getattr(F, "grouped_mm", None)
    if fn is None:  # torch < 2.10
        return torch._grouped_mm(a, b, offs=offs)
    return fn(a, b, offs=offs)


_grouped_mm_op = torch.library.custom_op("dropless::grouped_mm", _grouped_mm_eager, mutates_args=())


@_grouped_mm_op.register_fake
def _(a, b, offs):
    if b.dim() == 3:  # [M, K] x [e, K, N] -> [M, N]
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])  # [K, M] x [M, N] -> [e, K, N]


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return (_grouped_mm_op if torch.compiler.is_compiling() else _grouped_mm_eager)(a, b, offs)


@torch.compiler.assume_constant_result
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def wgrad_by_triton(x_MK: torch.Tensor, n: int) -> bool:
    """Whether the weight gradient ``x^T @ dy`` (``dy`` ``n`` wide) runs the Triton kernel instead of ``grouped_mm``.

    On CUDA: when one expert's 128 x 128 output tiles are fewer than the GPU's SMs. ``grouped_mm``
    takes the experts in order, so there a large expert's long tiles run alone at the end;
    :func:`dropless.ops.triton_wgrad.grouped_wgrad_` starts the largest experts first and needs no
    zero-fills. With more tiles than SMs (DeepSeek-V3's per-rank FC1: 1,792 per expert) every SM
    gets tiles of every expert and ``grouped_mm`` is faster. The rule and its threshold come from
    ``benchmarks/grouped_gemm.py`` (``benchmarks/results/grouped_gemm.jsonl``).
    Under Triton's interpreter (CPU tensors with ``select.FORCE_TRITON``): always."""
    if not select.use_triton(x_MK):
        return False
    if not x_MK.is_cuda:
        return True
    tiles = -(-x_MK.shape[1] // 128) * -(-n // 128)
    return tiles < _sm_count(x_MK.device.index if x_MK.device.index is not None else torch.cuda.current_device())


class TorchBackend:
    name = "torch"

    def check(self, x_MK: torch.Tensor, w_eKN: torch.Tensor) -> None:
        ok = (torch.float32, torch.bfloat16, torch.float16) if x_MK.device.type == "cpu" else (torch.bfloat16,)
        if x_MK.dtype not in ok:
            raise ValueError(
                f"gemm=torch: grouped_mm on {x_MK.device.type} takes {[str(d) for d in ok]}, got {x_MK.dtype}; "
                "use gemm=loop for other dtypes (e.g. float64 references)")
        esize = x_MK.element_size()
        for name, n in (("K (input width)", x_MK.shape[1]), ("N (output width)", w_eKN.shape[2])):
            if (n * esize) % 16:
                raise ValueError(
                    f"gemm=torch: {name}={n} gives a row stride of {n * esize} bytes; grouped_mm needs a "
                    f"multiple of 16 bytes (hidden_size and moe_intermediate_size multiples of {16 // esize}); "
                    "change the model shape or use gemm=loop")

    def gmm(self, x_MK: torch.Tensor, w_eKN: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        return _grouped_mm(x_MK, w_eKN, layout.end)

    def gmm_wgrad(self, x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        # both paths need unit column strides (grouped_mm: 16-byte strides of x^T and dy)
        x_MK = x_MK if x_MK.stride(1) == 1 else x_MK.contiguous()
        dy_MN = dy_MN if dy_MN.stride(1) == 1 else dy_MN.contiguous()
        if wgrad_by_triton(x_MK, dy_MN.shape[1]):  # reads live rows only: no zero-fills
            return triton_wgrad.grouped_wgrad(x_MK, dy_MN, layout)
        if layout.alignment > 1 and layout.num_experts > 1:
            # zero the gap rows of both operands (padding: nobody reads them), so that the groups
            # [end[i-1], end[i]) add exact zeros for them; no [2e, K, N] transient.
            x_MK = zero_gap_rows_(x_MK, layout)
            dy_MN = zero_gap_rows_(dy_MN, layout)
        # group i = [end[i-1], end[i]) is expert i's live rows (after its zeroed gap); grouped_mm
        # ignores the tail after end[e-1]
        dw = _grouped_mm(x_MK.t(), dy_MN, layout.end)
        return zero_empty_experts_(dw if dw.is_contiguous() else dw.contiguous(), layout.counts)

    def gmm_wgrad_into_(self, dw_eKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor,
                        layout: ExpertLayout) -> None:
        """``dw[i] = x[live_i]^T @ dy[live_i]`` written in place in ``dw``'s dtype (fp32 main gradients:
        summed in fp32 and never rounded to bf16; the Triton kernel where it is the faster one)."""
        if (wgrad_by_triton(x_MK, dy_MN.shape[1]) and dw_eKN.is_contiguous() and x_MK.stride(1) == 1
                and dy_MN.stride(1) == 1):
            triton_wgrad.grouped_wgrad_(dw_eKN, x_MK, dy_MN, layout, accumulate=False)
        else:
            dw_eKN.copy_(self.gmm_wgrad(x_MK, dy_MN, layout))

    def gmm_wgrad_acc_(self, dw_eKN: torch.Tensor, x_MK: torch.Tensor, dy_MN: torch.Tensor,
                       layout: ExpertLayout) -> None:
        """``dw[i] += x[live_i]^T @ dy[live_i]`` in place (the Triton kernel on CUDA)."""
        if select.use_triton(dw_eKN) and dw_eKN.is_contiguous() and x_MK.stride(1) == 1 and dy_MN.stride(1) == 1:
            triton_wgrad.grouped_wgrad_(dw_eKN, x_MK, dy_MN, layout, accumulate=True)
        else:
            dw_eKN.add_(self.gmm_wgrad(x_MK, dy_MN, layout))

