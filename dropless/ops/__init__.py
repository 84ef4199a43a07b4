"""Grouped GEMM backends and the live-row expert ops.

A backend computes, for the live rows of each local expert ``i`` (rows
``[start[i], end[i])`` of an :class:`~dropless.layout.ExpertLayout`)::

    gmm:        out[start:end] = x[start:end] @ w[i]            (x_MK, w_eKN -> out_MN)
    gmm_wgrad:  dw[i] = x[start:end]^T @ dy[start:end]          (x_MK, dy_MN -> dw_eKN)

Padding rows of ``out`` may hold anything; padding rows of the inputs never
reach a used output nor ``dw``; an empty expert gets ``dw[i] == 0`` exactly.

Backends (``gemm=…``):
    ``torch``  ``torch.nn.functional.grouped_mm`` (CPU: fp32/bf16/fp16; CUDA sm90: bf16).
    ``loop``   a per-expert reference loop (any dtype, float64 included); it reads
               the layout on the host, so it is for tests, not for speed.
    ``fp8``    forward and data-gradient GEMMs in e4m3 with rowwise scales
               (``torch._scaled_grouped_mm``, CUDA cc >= 8.9), bf16 weight gradients:
               :mod:`~dropless.ops.fp8_backend`, its quantisation :mod:`~dropless.ops.fp8_quant`,
               its fused SwiGLU-quant + FC2 node :mod:`~dropless.ops.fp8_mlp`.
    ``deep_gemm``  the same FP8 MLP through DeepGEMM's M-grouped contiguous GEMM (1×128
               activation / 128×128 weight scales, the layout's ``end[]`` as its psum
               layout; ``expert_alignment`` 128): :mod:`~dropless.ops.deep_gemm_backend`;
               a configuration error naming the package where ``deep_gemm`` does not import.

The memory-bound ops around the GEMMs, one file each, each holding its Triton kernel, its
torch reference and the one place that picks between them (:mod:`dropless.ops.select`):
:mod:`~dropless.ops.swiglu` (SwiGLU over live rows, its backward, the fused FP8 quantisation),
:mod:`~dropless.ops.rows` (permute, gather-sum / combine, combine backward),
:mod:`~dropless.ops.zero_fill` (gap rows, empty experts' gradients) and
:mod:`~dropless.ops.triton_wgrad` (the accumulating grouped weight gradient); and, outside the
MoE layer, :mod:`~dropless.ops.softmax_ce` (the LM head's chunked cross-entropy and its gradient),
:mod:`~dropless.ops.rope_tail` (MLA's RoPE on each head's last features, the head copied),
:mod:`~dropless.ops.keys_values` (MLA's per-head keys ``[k_nope | k_pe]`` and their gradient's join and head sum) and
:mod:`~dropless.ops.rms_norm` (RMSNorm with its input and weight gradients in one pass);
before the dispatch, :mod:`~dropless.ops.route_topk` (the router's biased group-limited top-k);
the dispatch's layout, :mod:`~dropless.ops.expert_sort` (each choice's landed row, the counts, starts and ends).
"""

from dropless.ops.backends import GemmBackend, get_backend, list_backends, register_backend
from dropless.ops.grouped_gemm import grouped_mm
from dropless.ops.select import use_triton

__all__ = ["GemmBackend", "get_backend", "list_backends", "register_backend", "grouped_mm", "use_triton"]
