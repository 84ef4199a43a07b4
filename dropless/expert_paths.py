"""The ways the routed experts compute, one class each; :func:`choose_path` picks one per layer at construction.

* :class:`GemmPath` — grouped GEMM (gate||up), SwiGLU (× row weight), grouped GEMM (down) as
  autograd composes them; with ``poison`` NaN goes into the padding rows of every intermediate
  and of its gradient (``poison_padding``, a debug setting).
* :class:`Fp8FusedPath` — the fused FP8 node (:mod:`dropless.ops.fp8_mlp`); the one path that
  takes rows landed as e4m3 codes (:mod:`dropless.ops.fp8_rows`). It never saves the SwiGLU
  output, so it serves ``recompute_swiglu`` as it is, and with ``gathers`` (``recompute_gather``)
  it takes a :class:`~dropless.permute.RowSource` and lands the rows' codes itself.
* :class:`RecomputePath` — the selective-recompute nodes (:mod:`dropless.ops.expert_mlp`):
  ``recompute_swiglu``, ``recompute_fc1`` and ``recompute_gather`` (rows given as a
  :class:`~dropless.permute.RowSource`, gathered inside FC1 and again in backward); with an FP8
  backend only for ``recompute_fc1`` (each FP8 GEMM there quantises its operand in a pass of its own).

Every path takes rows already in the compute dtype, weights from
:meth:`~dropless.experts.GroupedExperts.weights` and returns the ``[M, H]`` outputs in that
dtype (padding rows unspecified).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dropless.layout import ExpertLayout, poison_padding
from dropless.ops import GemmBackend, grouped_mm
from dropless.ops.backends import ExpertGemms
from dropless.ops.expert_mlp import RecomputeAhead, expert_mlp_recompute
from dropless.ops.fp8_backend import Fp8Backend
from dropless.ops.fp8_mlp import fp8_expert_mlp
from dropless.ops.fp8_policy import ALL_FP8, Fp8Plan
from dropless.ops.fp8_rows import Fp8Rows
from dropless.ops.grouped_gemm import WgradAccumulator, check_operands
from dropless.ops.swiglu import swiglu
from dropless.permute import RowSource


@dataclass
class ExpertWeights:
    """The experts' weights for one layer call, in the compute dtype (cast once for all chunks).

    Attributes:
        w13: ``[e, H, 2I]``. w2: ``[e, I, H]``.
        wgrad: the :class:`~dropless.ops.grouped_gemm.WgradAccumulator` summing the chunks'
            weight gradients in place, or None (each call returns its own).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    wgrad: WgradAccumulator | None


class ExpertPath:
    """One way to compute the experts. Class attributes say what a path accepts.

    Attributes:
        takes_fp8_rows: FC1 reads the rows as dispatched in FP8 (``fp8_rows``).
        gathers: the rows may come as a :class:`~dropless.permute.RowSource` (``recompute_gather``).
    """

    takes_fp8_rows = False
    gathers = False

    def __init__(self, backend: GemmBackend):
        self.backend = backend

    def __call__(self, rows: torch.Tensor | RowSource, layout: ExpertLayout, row_weight_M: torch.Tensor | None,
                 w: ExpertWeights, fp8_rows: Fp8Rows | None) -> torch.Tensor:
        raise NotImplementedError

    def ahead(self, y_MH: torch.Tensor) -> RecomputeAhead | None:
        """The :class:`~dropless.ops.expert_mlp.RecomputeAhead` of this path's output ``y_MH``, or None."""
        return None


class GemmPath(ExpertPath):
    """Grouped GEMMs and SwiGLU composed by autograd; ``poison`` marks every padding row NaN."""

    def __init__(self, backend: GemmBackend, poison: bool = False):
        super().__init__(backend)
        self.poison = poison

    def __call__(self, rows, layout, row_weight_M, w, fp8_rows):
        mark = (lambda t: poison_padding(t, layout)) if self.poison else (lambda t: t)
        acc = w.wgrad
        x = mark(rows)
        h13 = mark(grouped_mm(x, w.w13, layout, self.backend, wgrad=(acc, "w13") if acc is not None else None))
        h = swiglu(h13, layout)
        if row_weight_M is not None:
            h = h * row_weight_M.to(h.dtype).unsqueeze(1)
        return mark(grouped_mm(mark(h), w.w2, layout, self.backend, wgrad=(acc, "w2") if acc is not None else None))


class Fp8FusedPath(ExpertPath):
    """The fused FP8 node (:func:`~dropless.ops.fp8_mlp.fp8_expert_mlp`); FC1 takes landed FP8 rows as they are.

    With ``gathers`` (``recompute_gather``) the rows may come as their
    :class:`~dropless.permute.RowSource`: FC1 then lands their codes itself and they are never saved;
    such a path takes no dispatched FP8 rows.

    Attributes:
        plan: which of its GEMMs run in FP8 (:mod:`dropless.ops.fp8_policy`; the MoE layer sets it at
            its first forward); FC1 in bf16 takes no FP8 rows.
    """

    def __init__(self, backend: GemmBackend, plan: Fp8Plan = ALL_FP8, gathers: bool = False):
        super().__init__(backend)
        self.plan, self.gathers = plan, gathers

    @property
    def takes_fp8_rows(self) -> bool:
        return self.plan.fc1 and not self.gathers

    def __call__(self, rows, layout, row_weight_M, w, fp8_rows):
        source = rows if isinstance(rows, RowSource) else None
        ref = source.x_NH if source is not None else rows
        check_operands(ref.new_empty(layout.capacity, w.w13.shape[1]) if source is not None else rows, w.w13,
                       layout, self.backend)
        check_operands(ref.new_empty(layout.capacity, w.w2.shape[1]), w.w2, layout, self.backend)
        return fp8_expert_mlp(None if source is not None else rows, w.w13, w.w2, row_weight_M, layout, self.backend,
                              w.wgrad, landed=fp8_rows, plan=self.plan, source=source)


class RecomputePath(ExpertPath):
    """The selective-recompute nodes: the SwiGLU output is never saved, nor ``h13`` with ``recompute_fc1``.

    With ``gathers`` (``recompute_gather``) the rows may come as their
    :class:`~dropless.permute.RowSource` and are then never saved.

    Attributes:
        gemms: the backend of each GEMM; ``backend`` in every role, unless the MoE layer sets an FP8
            plan's (:meth:`~dropless.ops.fp8_policy.Fp8Plan.gemms`) at its first forward.
    """

    def __init__(self, backend: GemmBackend, recompute_fc1: bool, gathers: bool):
        super().__init__(backend)
        self.recompute_fc1, self.gathers = recompute_fc1, gathers
        self.gemms = ExpertGemms.of(backend)

    def __call__(self, rows, layout, row_weight_M, w, fp8_rows):
        source = rows if isinstance(rows, RowSource) else None
        x = None if source is not None else rows
        ref = source.x_NH if source is not None else x
        check_operands(ref.new_empty(layout.capacity, w.w13.shape[1]) if x is None else x, w.w13, layout, self.backend)
        check_operands(ref.new_empty(layout.capacity, w.w2.shape[1]), w.w2, layout, self.backend)
        return expert_mlp_recompute(x, w.w13, w.w2, row_weight_M, layout, self.gemms, self.recompute_fc1,
                                    source=source, wgrad=w.wgrad)

    def ahead(self, y_MH):
        return RecomputeAhead.of(y_MH) if self.recompute_fc1 else None


def choose_path(backend: GemmBackend, *, recompute_swiglu: bool = False, recompute_fc1: bool = False,
                recompute_gather: bool = False, poison: bool = False) -> ExpertPath:
    """The path for these settings: ``poison`` (a debug setting) overrides the others and lands the rows;
    an FP8 backend takes its fused node unless ``recompute_fc1`` (the node saves FC1's output);
    any recompute option takes the recompute nodes; else plain GEMMs."""
    if poison:
        return GemmPath(backend, poison=True)
    if isinstance(backend, Fp8Backend) and not recompute_fc1:
        return Fp8FusedPath(backend, gathers=recompute_gather)
    if recompute_fc1 or recompute_swiglu or recompute_gather:
        return RecomputePath(backend, recompute_fc1, gathers=recompute_gather)
    return GemmPath(backend)
