"""The ``loop`` grouped GEMM backend: one matmul per expert over its live rows.

A reference for tests: any dtype (float64 included), any strides. It reads
``start``/``end`` on the host (one sync per call), which the MoE path
otherwise forbids, so it is not for training speed.
"""

from __future__ import annotations

import torch

from dropless.layout import ExpertLayout


class LoopBackend:
    name = "loop"

    def check(self, x_MK: torch.Tensor, w_eKN: torch.Tensor) -> None:
        if not x_MK.dtype.is_floating_point:
            raise ValueError(f"gemm=loop: floating operands needed, got {x_MK.dtype}")

    def gmm(self, x_MK: torch.Tensor, w_eKN: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        out = x_MK.new_empty(x_MK.shape[0], w_eKN.shape[2])
        for i, (s, t) in enumerate(zip(layout.start.tolist(), layout.end.tolist())):
            if t > s:
                torch.matmul(x_MK[s:t], w_eKN[i], out=out[s:t])
        return out

    def gmm_wgrad(self, x_MK: torch.Tensor, dy_MN: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
        e = layout.num_experts
        dw = x_MK.new_zeros(e, x_MK.shape[1], dy_MN.shape[1])
        for i, (s, t) in enumerate(zip(layout.start.tolist(), layout.end.tolist())):
            if t > s:
                torch.matmul(x_MK[s:t].t(), dy_MN[s:t], out=dw[i])
        return dw
