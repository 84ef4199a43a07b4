"""FC2's output gradient quantised by the combine's backward, which writes those rows anyway.

FC2's data gradient multiplies the e4m3 codes of ``dy_MH``, the gradient rows the combine's
backward (:func:`~dropless.ops.rows.combine_bwd`) writes. The FP8 FC2 node asks for them on
its output tensor (:func:`ask`); the combine's backward, seeing the request on the rows it
combined, writes the codes and scales in the same pass
(:func:`~dropless.ops.fp8_fused_rows.combine_bwd_quant`) and leaves them in the request
(:meth:`GradCodes.put`); FC2's backward takes them (:meth:`GradCodes.take`) when the gradient
it received is the very tensor the combine returned (not a sum with another consumer's
gradient, not a cast of it), and quantises ``dy_MH`` itself otherwise. The codes are those the
separate quantisation would make, so the result does not depend on which path ran.
"""

from __future__ import annotations

import torch

_ATTR = "_dropless_grad_codes"


class GradCodes:
    """A request for the codes and scales of a tensor's gradient rows, and their answer.

    Attributes:
        group: 0 (one scale per row) or 128 (per row per 128 columns).
        ue8m0: power-of-two scales.
        fused: gradients whose codes came from the combine (tests; counts :meth:`take` hits).
    """

    def __init__(self, group: int, ue8m0: bool):
        self.group, self.ue8m0 = group, ue8m0
        self.fused = 0
        self._answer: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def put(self, grad_MH: torch.Tensor, codes_MH: torch.Tensor, scales: torch.Tensor) -> None:
        """Leave the codes and scales of ``grad_MH`` (the combine's backward)."""
        self._answer = (grad_MH, codes_MH, scales)

    def take(self, grad_MH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(codes, scales)`` when they were made for this very ``grad_MH``, else None; the answer is dropped."""
        answer, self._answer = self._answer, None
        if answer is None or answer[0] is not grad_MH:
            return None
        self.fused += 1
        return answer[1], answer[2]


def ask(y_MH: torch.Tensor, group: int, ue8m0: bool) -> GradCodes:
    """Ask whoever combines ``y_MH`` for its gradient rows' codes; returns the request (kept by the asker)."""
    req = GradCodes(group, ue8m0)
    setattr(y_MH, _ATTR, req)
    return req


def asked(y_MH: torch.Tensor) -> GradCodes | None:
    """The request on ``y_MH``, or None (none made, or ``torch.compile`` is tracing: no Python state on tensors)."""
    if torch.compiler.is_compiling():
        return None
    return getattr(y_MH, _ATTR, None)
