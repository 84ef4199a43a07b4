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

On CUDA with Triton, the memory-bound steps around the GEMMs (SwiGLU over live rows,
the combine and the permutation's backward) run as fused kernels
(:mod:`dropless.ops.triton_kernels`); elsewhere plain torch ops compute the same.
"""

import torch

from dropless.ops.backends import GemmBackend, get_backend, list_backends, register_backend
from dropless.ops.grouped_gemm import grouped_mm

try:  # the live-row Triton kernels (dropless.ops.triton_kernels) need triton and CUDA
    import triton  # noqa: F401

    _HAS_TRITON = True
except ImportError:  # CPU installs: the torch implementations are used instead
    _HAS_TRITON = False


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` is on CUDA and Triton imports: the fused live-row kernels then run."""
    return _HAS_TRITON and t.is_cuda


__all__ = ["GemmBackend", "get_backend", "list_backends", "register_backend", "grouped_mm", "use_triton"]
