"""Where the MoE ops choose between their Triton kernel and their torch reference.

Every op file under :mod:`dropless.ops` (``swiglu``, ``rows``, ``zero_fill``, ``fp8_quant``,
``triton_wgrad``, ``route_topk``, ``softmax_ce``, ``rope_tail``, ``keys_values``, ``rms_norm``,
``expert_sort``) has one public function per op that asks :func:`use_triton` once and runs either its
Triton kernel or its torch reference.
Outside ``ops`` one caller asks too: :func:`dropless.mlp.gate_up_kernels`, which picks the FFN's
form (one ``[w1; w3]`` GEMM feeding the SwiGLU kernels, or the plain ops) rather than a kernel.
Tests that run the CUDA code path on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``) set :data:`FORCE_TRITON` (or monkeypatch :func:`use_triton`).
"""

from __future__ import annotations

import os

import torch

try:  # the live-row Triton kernels need triton (and CUDA, or its CPU interpreter)
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # CPU installs: the torch references run instead
    HAS_TRITON = False

#: Take the Triton path for CPU tensors too (only meaningful under ``TRITON_INTERPRET=1``).
FORCE_TRITON = False


def interpreting() -> bool:
    """True when Triton's CPU interpreter is on (``TRITON_INTERPRET=1`` before triton was imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when the op on ``t`` runs its Triton kernel: ``t`` on CUDA and Triton importable (or forced)."""
    return HAS_TRITON and (t.is_cuda or FORCE_TRITON)
