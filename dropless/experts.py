"""Routed SwiGLU experts over a live-row layout (grouped GEMM gate||up, SwiGLU, down)."""

from __future__ import annotations

import torch
from torch import nn

from dropless.expert_paths import ExpertPath, ExpertWeights, choose_path
from dropless.layout import ExpertLayout
from dropless.ops import GemmBackend, get_backend
from dropless.ops.expert_mlp import RecomputeAhead
from dropless.ops.fp8_rows import Fp8Rows
from dropless.ops.grouped_gemm import WgradAccumulator
from dropless.permute import RowSource

__all__ = ["ExpertWeights", "GroupedExperts", "RecomputeAhead", "compute_dtype", "init_expert_weights_"]


def init_expert_weights_(w13_eHI2: torch.Tensor, w2_eIH: torch.Tensor, seed: int, layer_id: int,
                         expert_offset: int, std: float) -> None:
    """Initialise local experts from their GLOBAL expert index, independent of the layout.

    Expert ``g`` (global id) draws from a generator seeded by ``(seed, layer_id, g)``, so the
    same seed gives the same global expert weights whatever EP is (runs compare across
    parallel layouts). Both weights ~ Normal(0, ``std``), drawn in fp32 on the CPU and
    copied in (the same values on any device or dtype). No-op on the meta device.
    """
    if w13_eHI2.is_meta:
        return
    e = w13_eHI2.shape[0]
    with torch.no_grad():
        for i in range(e):
            g = torch.Generator(device="cpu")
            g.manual_seed((int(seed) * 1_000_003 + int(layer_id) * 10_007 + expert_offset + i) & 0x7FFF_FFFF_FFFF)
            a = torch.empty(w13_eHI2.shape[1:], dtype=torch.float32).normal_(0.0, std, generator=g)
            b = torch.empty(w2_eIH.shape[1:], dtype=torch.float32).normal_(0.0, std, generator=g)
            w13_eHI2[i].copy_(a)
            w2_eIH[i].copy_(b)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts compute in for input ``x``: autocast's when it is on, else ``x``'s."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class GroupedExperts(nn.Module):
    """``e`` local SwiGLU experts: ``y = (silu(x W_gate) * (x W_up)) W_down`` per expert.

    Parameters:
        w13: ``[e, H, 2I]`` fused gate||up (gate in the first ``I`` columns).
        w2: ``[e, I, H]`` down projection.
    Args:
        hidden_size: ``H``. moe_intermediate_size: ``I``. num_local_experts: ``e``.
        gemm: grouped GEMM backend name (:func:`dropless.ops.list_backends`), or a backend
            instance (e.g. ``Fp8Backend(emulate=True)`` in CPU tests). With ``fp8`` the default
            path (no recompute option, no ``poison``) is the fused FP8 node
            (:mod:`dropless.ops.fp8_mlp`); the recompute paths run the backend's FP8 GEMMs
            through the recompute nodes. Setting :attr:`backend` later chooses the path again.
        expert_offset: global id of local expert 0 (``ep_rank · e``), for layout-independent init.
        recompute_swiglu: do not save the SwiGLU output; recompute it from ``h13`` in backward.
        recompute_fc1: do not save ``h13`` either; rerun the FC1 GEMM in backward. Either
            option saves no more than the landed rows (plus ``h13`` for ``recompute_swiglu``).
        recompute_gather: :meth:`forward` may take the rows' source instead of the rows
            (gathered inside FC1 and again in backward; the recompute path).
        poison: debug (``poison_padding``): write NaN into the padding rows of every
            intermediate and of its gradient; runs the plain GEMM path, on landed rows.
    The path (:mod:`dropless.expert_paths`) is chosen here, once, from the backend and these options.
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_local_experts: int,
                 gemm: "str | GemmBackend" = "torch", expert_offset: int = 0, recompute_swiglu: bool = False,
                 recompute_fc1: bool = False, recompute_gather: bool = False, poison: bool = False):
        super().__init__()
        self.recompute_swiglu, self.recompute_fc1 = recompute_swiglu, recompute_fc1
        self.recompute_gather, self.poison = recompute_gather, poison
        self.hidden_size, self.moe_intermediate_size = hidden_size, moe_intermediate_size
        self.num_local_experts, self.expert_offset = num_local_experts, expert_offset
        self.backend = get_backend(gemm) if isinstance(gemm, str) else gemm
        self.w13 = nn.Parameter(torch.empty(num_local_experts, hidden_size, 2 * moe_intermediate_size))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, moe_intermediate_size, hidden_size))

    def init_weights(self, seed: int, layer_id: int, std: float = 0.02) -> None:
        init_expert_weights_(self.w13, self.w2, seed, layer_id, self.expert_offset, std)

    def weights(self, dtype: torch.dtype, accumulate_wgrad: bool = False) -> ExpertWeights:
        """The weights cast to ``dtype`` once, for one layer call of one or more chunks.

        Args:
            dtype: compute dtype (autocast's, or the rows' dtype).
            accumulate_wgrad: sum the chunks' weight gradients in place in one buffer per
                weight (:class:`~dropless.ops.grouped_gemm.WgradAccumulator`) rather than
                letting autograd add a fresh one per chunk. Ignored without grad mode, and
                while ``torch.compile`` traces the layer (the accumulator is Python state
                shared by backward nodes, which Dynamo cannot trace: autograd sums the chunks).

        A weight with a ``main_grad_sink`` attribute (a :class:`~dropless.ops.grouped_gemm.GradSink`
        that the trainer's gradient buckets set on bf16 parameters) gets its gradient written into
        that fp32 buffer by the weight-gradient kernel, chunks or not, under the same conditions
        (grad mode, not compiling); autograd gets a placeholder.
        """
        w13, w2 = self.w13, self.w2
        acc = None
        if torch.is_grad_enabled() and (w13.requires_grad or w2.requires_grad) and not torch.compiler.is_compiling():
            sinks = {n: s for n, s in (("w13", getattr(w13, "main_grad_sink", None)),
                                       ("w2", getattr(w2, "main_grad_sink", None))) if s is not None}
            if accumulate_wgrad or sinks:
                acc = WgradAccumulator(self.backend, sinks)
                w13, w2 = acc.collect(w13, "w13"), acc.collect(w2, "w2")
        w13c, w2c = w13.to(dtype), w2.to(dtype)
        alias = getattr(self.backend, "alias", None)
        if alias is not None:  # the FP8 cache keys on the parameters, so a cast copy reuses their FP8 copies
            alias(w13c, self.w13)
            alias(w2c, self.w2)
        return ExpertWeights(w13c, w2c, acc)

    @property
    def backend(self) -> GemmBackend:
        return self.path.backend

    @backend.setter
    def backend(self, backend: GemmBackend) -> None:
        """Setting the backend chooses the path again (:func:`~dropless.expert_paths.choose_path`)."""
        self.path: ExpertPath = choose_path(backend, recompute_swiglu=self.recompute_swiglu,
                                            recompute_fc1=self.recompute_fc1,
                                            recompute_gather=self.recompute_gather, poison=self.poison)

    @property
    def takes_fp8_rows(self) -> bool:
        """True when FC1 reads e4m3 codes of its rows and can take them as dispatched (:mod:`dropless.ops.fp8_rows`):
        an FP8 backend on the path that neither recomputes nor poisons."""
        return self.path.takes_fp8_rows

    @property
    def gathers(self) -> bool:
        """True when :meth:`forward` takes the rows' ``source`` (``recompute_gather`` without ``poison``)."""
        return self.path.gathers

    def ahead(self, y_MH: torch.Tensor) -> RecomputeAhead | None:
        """The :class:`RecomputeAhead` of :meth:`forward`'s output ``y_MH``, to attach to the combined
        output (``recompute_fc1``, eager, with an autograd graph); else None."""
        return self.path.ahead(y_MH)

    def forward(self, rows_MH: torch.Tensor | None, layout: ExpertLayout, row_weight_M: torch.Tensor | None = None,
                *, weights: ExpertWeights | None = None, source: RowSource | None = None,
                fp8_rows: Fp8Rows | None = None) -> torch.Tensor:
        """Run the experts on the live rows, on the path chosen at construction.

        Args:
            rows_MH: ``[M, H]`` landed rows (padding rows unspecified); None with ``source``.
            layout: their :class:`ExpertLayout` (``e`` = ``num_local_experts``).
            row_weight_M: optional ``[M]`` routing weight per row, multiplied into the
                SwiGLU output before FC2 (``fold_routing_weights``).
            weights: from :meth:`weights` (shared by the chunks of a layer call); default:
                cast here, gradients returned to autograd.
            source: the rows' :class:`~dropless.permute.RowSource` instead of ``rows_MH``
                (only where :attr:`gathers`): the rows are gathered inside the FC1 node and
                re-gathered in backward, never saved.
            fp8_rows: the rows as the dispatcher landed them in FP8 (``rows_MH`` is then its
                :func:`~dropless.ops.fp8_rows.grad_port`): FC1 multiplies them as they are.
                Only where :attr:`takes_fp8_rows`.
        Returns:
            ``[M, H]`` expert outputs in the compute dtype; padding rows unspecified. Its
            :class:`RecomputeAhead`, if any, comes from :meth:`ahead`.
        Raises:
            ValueError: ``fp8_rows`` or ``source`` where the path does not take them.
        """
        if fp8_rows is not None and not self.takes_fp8_rows:
            raise ValueError("GroupedExperts: rows landed in FP8 need an FP8 backend (gemm=fp8 / deep_gemm) "
                             "without recompute_fc1, recompute_swiglu, recompute_gather or poison_padding; "
                             "dispatch them in the compute dtype")
        if source is not None and not self.gathers:
            raise ValueError("GroupedExperts: a row source needs experts built with recompute_gather "
                             "(and without poison); pass the landed rows")
        ref = rows_MH if source is None else source.x_NH
        dt = compute_dtype(ref)
        if weights is None:
            weights = self.weights(dt)
        with torch.autocast(ref.device.type, enabled=False):
            rows = rows_MH.to(dt) if source is None else RowSource(source.x_NH.to(dt), source.src_M, source.dest_Nk)
            return self.path(rows, layout, row_weight_M, weights, fp8_rows)
