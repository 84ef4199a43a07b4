"""The dropless MoE layer: router -> dispatcher -> grouped-GEMM experts -> combine (+ shared experts).

docs/design.md#the-pipeline::

    x_TH ─ Router ─ topk_idx_Tk, topk_weight_Tk
         ─ Dispatcher.dispatch ─ rows_MH + ExpertLayout
         ─ Experts: FC1 (gate||up) ─ SwiGLU ─ FC2, over live rows
         ─ Dispatcher.combine ─ y_TH (weighted sum over k + shared experts' output on x_TH,
                                     one fp32 accumulation, rounded once)
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dropless.config import ModelArgs
from dropless.dispatch import Dispatcher, LocalDispatcher, Pending
from dropless.expert_paths import Fp8FusedPath, RecomputePath
from dropless.experts import GroupedExperts, compute_dtype
from dropless.mlp import FeedForward
from dropless.ops.fp8_backend import Fp8Backend
from dropless.ops.fp8_policy import (
    ALL_FP8,
    Fp8Plan,
    crossover_table,
    describe,
    expected_rows_per_expert,
    plan_fp8,
    quant_of,
)
from dropless.ops.fp8_rows import RowQuantiser
from dropless.routing import Router, in_backward_recompute


class _LastAuxLoss:
    """Holds the last forward's aux-loss tensor (a graph tensor) for :attr:`MoE.aux_loss`.

    A copy of the module (``copy.deepcopy``, pickling) starts empty: a non-leaf tensor
    cannot be deep-copied, and a copy has run no forward.
    """

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> "_LastAuxLoss":
        return _LastAuxLoss()

    def __reduce__(self):
        return (_LastAuxLoss, ())


def _is_fsdp_managed(module: nn.Module) -> bool:
    """True when FSDP2 shards ``module`` (its parameters are gathered in its forward only)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(module, FSDPModule)


def capacity_drop(topk_idx_Tk: torch.Tensor, num_experts: int, capacity_factor: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The old token-dropping baseline: each expert keeps its first ``C`` rows.

    ``C = ceil(capacity_factor · T·k / E)`` (docs/design.md#why-dropless), with ``T`` the tokens given (the
    rank's); rows are kept in token order (GShard / Switch convention), the rest are dropped
    (index set to -1). No host sync. Memory: a ``[T·k, E]`` int64 one-hot (baseline only).

    Args:
        topk_idx_Tk: int64 ``[T, k]`` routed expert ids (``< 0``: already dropped).
        num_experts: ``E``. capacity_factor: ``> 0``.

    Returns:
        topk_idx_Tk with dropped choices set to -1, rows dropped (0-dim int64),
        rows padded (``E·C`` minus rows kept; 0-dim int64).
    """
    t, k = topk_idx_Tk.shape
    cap = math.ceil(capacity_factor * t * k / num_experts)
    flat = topk_idx_Tk.reshape(-1)
    valid = flat >= 0
    idx = flat.clamp(min=0).unsqueeze(1)
    # one-hot by scatter (F.one_hot validates its input with a host sync on CUDA)
    onehot = torch.zeros(flat.numel(), num_experts, dtype=torch.int64, device=flat.device)
    onehot.scatter_(1, idx, valid.to(torch.int64).unsqueeze(1))
    rank = (torch.cumsum(onehot, 0) - onehot).gather(1, idx).squeeze(1)  # earlier rows of the same expert
    keep = valid & (rank < cap)
    dropped = (valid & ~keep).sum()
    padded = num_experts * cap - keep.sum()
    return torch.where(keep, flat, torch.full_like(flat, -1)).view(t, k), dropped, padded


_FP8_PLANS_SAID: set[tuple] = set()  # FP8 plans already announced in this process (_apply_fp8_plan)


class MoE(nn.Module):
    """A DeepSeek-V3 MoE layer that drops no token.

    Args:
        args: the model config (DeepSeek-V3 names; see :class:`~dropless.config.ModelArgs`).
        layer_id: decoder layer index (for error messages, stats and the weight-init seed).
        dispatcher: how tokens reach the experts (default :class:`LocalDispatcher`, EP = 1).

    Shapes: ``forward(x_BSH)`` -> ``[B, S, H]`` (or ``x_TH`` -> ``[T, H]``), same dtype as ``x``;
    ``forward(x, return_aux=True)`` -> ``(y, aux_loss)``.

    The sequence-wise auxiliary loss is not added to anything by the layer: it joins the loss
    the caller backpropagates (``loss = task_loss + moe.aux_loss``), so every factor on that
    loss (``1/grad_accum``, a loss scale, a weighted sum of losses) scales its gradient too.
    A sequence is the ``S`` dimension of a 3-D input; a 2-D input is one sequence.

    Attributes:
        aux_loss: fp32 0-dim, the α-weighted sequence-wise aux loss of the last forward that
            was not an activation-checkpointing recompute (differentiable wrt the router's
            weight and ``x`` in training mode; exact 0 in eval mode or with
            ``aux_loss_alpha = 0``); None before the first forward. Under
            ``torch.utils.checkpoint`` take it from ``forward(x, return_aux=True)`` inside
            the checkpointed function and return it from there (the recompute's own aux
            loss is then the one that backward sees, in both ``use_reentrant`` modes).
        router: :class:`~dropless.routing.Router`.
        experts: :class:`~dropless.experts.GroupedExperts` holding the ``e = E/EP`` local experts.
        shared_experts: :class:`~dropless.mlp.FeedForward` of width
            ``n_shared_experts · moe_intermediate_size`` on every token, or None.
        last_stats: device tensors of the last forward: ``rows_dropped``, ``rows_padded``
            (capacity-factor baseline; 0 when dropless), ``rows_live``, ``rows_capacity``.
    Raises:
        ConfigError: an invalid config field (named, with the layer).
        ValueError: ``x`` of the wrong shape or dtype.
    """

    def __init__(self, args: ModelArgs, layer_id: int = 0, dispatcher: Dispatcher | None = None):
        super().__init__()
        args.validate(layer=str(layer_id))
        self.args, self.layer_id = args, layer_id
        self.dispatcher = dispatcher if dispatcher is not None else LocalDispatcher(args.n_routed_experts)
        if self.dispatcher.num_experts != args.n_routed_experts:
            raise ValueError(f"layer {layer_id}: dispatcher built for {self.dispatcher.num_experts} experts but "
                             f"n_routed_experts={args.n_routed_experts}")
        if args.recompute_gather:
            self.dispatcher.check_regather()
        if args.num_token_chunks > 1 and self.dispatcher.shards_experts:  # shown once per process
            warnings.warn(f"num_token_chunks={args.num_token_chunks} with dispatcher={self.dispatcher.name} runs "
                          "the FSDP2-sharded experts once per chunk, so each MoE layer all-gathers its expert "
                          f"weights {args.num_token_chunks} times per forward (and again in backward); use "
                          f"num_token_chunks=1 with {self.dispatcher.name} unless memory needs it", stacklevel=1)
        self.router = Router(args, layer_id)
        self.experts = GroupedExperts(args.hidden_size, args.moe_intermediate_size,
                                      self.dispatcher.num_local_experts, gemm=args.gemm,
                                      expert_offset=self.dispatcher.expert_offset,
                                      recompute_swiglu=args.recompute_swiglu, recompute_fc1=args.recompute_fc1,
                                      recompute_gather=args.recompute_gather, poison=args.poison_padding)
        check_alignment = getattr(self.experts.backend, "check_alignment", None)
        if check_alignment is not None:  # e.g. gemm=deep_gemm reads the layout's ends at its own M alignment
            check_alignment(args.expert_alignment)
        if (isinstance(self.experts.backend, Fp8Backend) and self.dispatcher.lands_fp8  # shown once per process
                and self.dispatcher.expert_parallel and not self.experts.takes_fp8_rows):
            warnings.warn(f"gemm={args.gemm} with dispatcher={self.dispatcher.name}: the rows are dispatched in the "
                          "compute dtype, not as FP8 codes + scales, because recompute_fc1 or poison_padding is on "
                          "(those paths quantise the landed rows themselves); turn them off for FP8 dispatch "
                          "(docs/design.md#fp8-dispatch)", stacklevel=1)
        self.shared_experts = (FeedForward(args.hidden_size, args.n_shared_experts * args.moe_intermediate_size)
                               if args.n_shared_experts > 0 else None)
        self._fp8_plan: Fp8Plan | None = None  # decided at the first forward (_apply_fp8_plan)
        self.last_stats: dict[str, torch.Tensor] = {}
        self._aux = _LastAuxLoss()

    @property
    def aux_loss(self) -> torch.Tensor | None:
        return self._aux.value

    def init_weights(self, seed: int | None = None) -> None:
        """Deterministic, layout-independent init (same global weights for any EP)."""
        seed = self.args.seed if seed is None else seed
        std = self.args.initializer_range
        g = torch.Generator(device="cpu")  # drawn on the CPU, so every device gets the same weights
        g.manual_seed(seed * 7919 + self.layer_id)
        self.router.reset_parameters(generator=g)  # weight from g; balancing bias and counters zeroed
        dense = []
        if self.shared_experts is not None:
            dense += [lin.weight for lin in (self.shared_experts.w1, self.shared_experts.w3, self.shared_experts.w2)]
        with torch.no_grad():
            for w in dense:
                if not w.is_meta:
                    w.copy_(torch.empty(w.shape, dtype=torch.float32).normal_(0.0, std, generator=g))
        self.experts.init_weights(seed, self.layer_id, std)

    def forward(self, x: torch.Tensor, return_aux: bool = False):
        """Route, dispatch, compute and combine ``x`` (``[B, S, H]`` or ``[T, H]``; T, S or B may be 0).

        Returns ``y`` (shape and dtype of ``x``), or ``(y, aux_loss)`` with ``return_aux``
        (``aux_loss`` as the attribute; see the class docstring).
        """
        a = self.args
        if x.dim() not in (2, 3) or x.shape[-1] != a.hidden_size or not x.dtype.is_floating_point:
            raise ValueError(f"MoE layer {self.layer_id}: x must be floating [B, S, hidden_size={a.hidden_size}] "
                             f"or [T, hidden_size]; got {tuple(x.shape)} {x.dtype}")
        seq_len = x.shape[1] if x.dim() == 3 else None
        x_TH = x.reshape(-1, a.hidden_size)
        # Launch order (eager): the shared experts first and the router's counts and aux loss
        # (Router.account) after the routed experts, so that the GPU has GEMMs queued while the host
        # launches the router's and the dispatch's many small kernels. The outputs and the parameters'
        # gradients do not depend on it; x's gradient adds its three parts (shared, routed, router) in
        # this order, so it can differ in the last bit from a sum in another order.
        y_sh = None
        if self.shared_experts is not None:
            if a.recompute_fc1 and torch.is_grad_enabled():  # save only x_TH, recompute in backward
                y_sh = checkpoint(self.shared_experts, x_TH, use_reentrant=False)
            else:
                y_sh = self.shared_experts(x_TH)
        r = self.router(x_TH, seq_len=seq_len, account=False)
        topk_idx_Tk = r.topk_idx_Tk
        stats: dict[str, torch.Tensor] = {}
        if a.capacity_factor is not None:
            topk_idx_Tk, stats["rows_dropped"], stats["rows_padded"] = capacity_drop(
                topk_idx_Tk, a.n_routed_experts, a.capacity_factor)
        # the shared output joins the combine's fp32 sum: the layer's output is rounded once
        y_TH = self._routed(x_TH, topk_idx_Tk, r.topk_weight_Tk, stats, y_sh)
        self.router.account(r)
        self.last_stats = stats
        if not in_backward_recompute():  # a recompute's graph is not kept alive on the module
            self._aux.value = r.aux_loss
        y = y_TH.view(x.shape).to(x.dtype)
        return (y, r.aux_loss) if return_aux else y

    def _apply_fp8_plan(self, tokens: int) -> None:
        """Decide, at the layer's first forward, which expert GEMMs run in FP8 (:mod:`dropless.ops.fp8_policy`).

        On the FP8 paths (the fused node and the recompute nodes with an FP8 backend whose
        ``plan_gemms`` is on; off, every GEMM runs in FP8). The plan is
        made once, from the expected rows per local expert of that call (``tokens`` per chunk,
        balanced routing over the EP group) and the crossover measured nearest the layer's ``H``,
        ``I`` and local experts for where each GEMM's operand is quantised on this path
        (:func:`~dropless.ops.fp8_policy.quant_of`), kept for every later call, and said once per
        process for each distinct plan and shape (a warning naming the first layer, the GEMMs that
        run in bf16 and the crossover they are below).
        """
        path = self.experts.path
        fused = isinstance(path, Fp8FusedPath)
        if not (fused or isinstance(path, RecomputePath) and isinstance(path.backend, Fp8Backend)):
            return
        if not path.backend.plan_gemms:  # every GEMM in FP8 (Fp8Backend's plan_gemms)
            self._set_plan(path, ALL_FP8)
            return
        if self._fp8_plan is None and tokens == 0:  # nothing to judge by: FP8 for this call, decide later
            self._set_plan(path, ALL_FP8)
            return
        if self._fp8_plan is None:
            a, be, d = self.args, path.backend, self.dispatcher
            rows = expected_rows_per_expert(tokens, a.num_experts_per_tok, a.n_routed_experts, d.ep_size)
            quant = quant_of(fused, be.fused_quant, fused and d.lands_fp8 and d.expert_parallel)
            table, measured_at = crossover_table(a.hidden_size, a.moe_intermediate_size, d.num_local_experts, quant)
            plan = plan_fp8(rows, table)
            if be.wgrad == "bf16":  # the weight gradient is bf16 already: nothing to say about it
                plan = dataclasses.replace(plan, wgrad=True)
            self._fp8_plan = plan
            msg = describe(plan, f"layer {self.layer_id} (and every MoE layer of this shape)", rows,
                           a.hidden_size, a.moe_intermediate_size, table, measured_at)
            key = (tuple(plan.bf16_gemms()), round(rows), a.hidden_size, a.moe_intermediate_size, measured_at,
                   tuple(quant.values()))
            if msg is not None and key not in _FP8_PLANS_SAID:
                _FP8_PLANS_SAID.add(key)
                warnings.warn(msg, stacklevel=2)
        self._set_plan(path, self._fp8_plan)

    @staticmethod
    def _set_plan(path, plan: Fp8Plan) -> None:
        if isinstance(path, Fp8FusedPath):
            path.plan = plan
        else:
            path.gemms = plan.gemms(path.backend)

    def _row_quantiser(self, dtype: torch.dtype) -> RowQuantiser | None:
        """FC1's row quantisation for FP8 dispatch (docs/design.md#fp8-dispatch), or None to dispatch rows.

        FP8 dispatch needs an FP8 backend whose FC1 reads the codes as dispatched
        (:attr:`~dropless.experts.GroupedExperts.takes_fp8_rows`) and a dispatcher that moves them
        (:attr:`~dropless.dispatch.Dispatcher.lands_fp8`: ``a2a``, ``agrs``, and ``local`` / ``fsdp``,
        whose gather writes the codes as it lands the rows);
        the constructor warns once where the backend is FP8 but the rows cannot go as FP8 through
        a collective. The quantiser carries the backend's scale form (``act_group``, ``ue8m0``) for
        the landing kernel, unless the backend's ``fused_quant`` is off (the local gather then
        lands rows only and FC1 quantises them).
        """
        be = self.experts.backend
        if not (self.dispatcher.lands_fp8 and self.experts.takes_fp8_rows):
            return None
        group = be.act_group if be.fused_quant else None
        return RowQuantiser(lambda x_MK: be.quant_act(x_MK, None), dtype, group=group, ue8m0=be.ue8m0)

    def _routed(self, x_TH, topk_idx_Tk, topk_weight_Tk, stats, y_sh=None):
        """Dispatch -> experts -> combine (+ ``y_sh``) over ``num_token_chunks`` chunks of the rank's tokens.

        ``y_sh``: ``[T, H]`` shared experts' output or None; each chunk's rows of it are the
        addend of that chunk's combine (:meth:`~dropless.dispatch.Dispatcher.combine_async`),
        added to the fp32 weighted sum before its one rounding.

        With N > 1 the rank's tokens go through in N contiguous chunks, so only one chunk's
        landed buffers and expert intermediates are alive at once in forward (and one
        chunk's gradient buffers in backward). The dispatch of chunk c+1 is issued
        (``dispatch_async``; asynchronous collectives for a2a and agrs) before chunk c's
        experts run, and chunk c's combine is issued before chunk c+1's experts, so the
        collectives overlap expert compute. Outputs equal N = 1: every row sees the same
        expert and the combine sums over k in the same order.

        The expert weights are cast to the compute dtype once for all chunks
        (:meth:`GroupedExperts.weights`), and with N > 1 the chunks' weight gradients are
        summed in place into one buffer per weight (:class:`~dropless.ops.grouped_gemm.WgradAccumulator`)
        instead of one fresh ``[e, H, 2I]`` / ``[e, I, H]`` gradient per chunk. Under FSDP2
        (``dispatcher=fsdp``) the weights exist only inside the experts' forward, so each
        chunk casts its own and autograd sums the gradients. With ``recompute_gather`` the
        dispatcher lands no rows (:meth:`~dropless.dispatch.Dispatcher.dispatch_source`): the
        experts gather them from ``x_TH`` and gather again in backward. With
        ``recompute_fc1`` each chunk's combined output carries a
        :class:`~dropless.experts.RecomputeAhead`, so that FC1's output is rebuilt (and the
        re-gathered rows freed) before the combine's backward lands the ``[M, H]`` row
        gradient (where the combine finishes at once, or N = 1; not under FSDP2).
        """
        a = self.args
        n_chunks = max(1, min(a.num_token_chunks, x_TH.shape[0])) if x_TH.shape[0] else 1
        bounds = [x_TH.shape[0] * c // n_chunks for c in range(n_chunks + 1)]
        disp = self.dispatcher
        regather = self.experts.gathers  # recompute_gather; the poisoned debug path lands the rows
        weights = None
        if not _is_fsdp_managed(self.experts):  # FSDP2 gathers the weights in experts' forward
            weights = self.experts.weights(compute_dtype(x_TH), accumulate_wgrad=n_chunks > 1)

        self._apply_fp8_plan(bounds[1] - bounds[0])  # before the quantiser: FC1 in bf16 takes no FP8 rows
        quant = self._row_quantiser(compute_dtype(x_TH))

        def issue(c):
            lo, hi = bounds[c], bounds[c + 1]
            kw = dict(alignment=a.expert_alignment, fold_weights=a.fold_routing_weights)
            if quant is not None:
                kw["quant"] = quant
            if regather:  # no rows landed: the experts gather them (and again in backward)
                return Pending(value=disp.dispatch_source(x_TH[lo:hi], topk_idx_Tk[lo:hi], topk_weight_Tk[lo:hi], **kw))
            return disp.dispatch_async(x_TH[lo:hi], topk_idx_Tk[lo:hi], topk_weight_Tk[lo:hi], **kw)

        pending = issue(0)
        combines, live, cap = [], [], 0
        for c in range(n_chunks):
            d = pending.wait()
            if c + 1 < n_chunks:
                pending = issue(c + 1)  # next chunk's dispatch overlaps this chunk's experts
            y_MH = self.experts(d.rows_MH, d.layout, d.row_weight_M, weights=weights,
                                source=d.source if regather else None, fp8_rows=d.fp8)
            ahead = self.experts.ahead(y_MH)
            live.append(d.layout.counts.sum())
            cap = max(cap, d.layout.capacity)
            pending_y = disp.combine_async(y_MH, d.handle,
                                           None if y_sh is None else y_sh[bounds[c]:bounds[c + 1]])
            if ahead is not None and weights is not None and (pending_y.done or n_chunks == 1):
                # a hook rebuilds FC1's output right before this chunk's combine backward lands the
                # [M, H] row gradient. Not on the output of an asynchronous collective with N > 1:
                # those backward nodes run before every chunk's experts (all h13 rebuilt up front)
                pending_y = Pending(value=ahead.attach(pending_y.wait()))
            combines.append(pending_y)
        outs = [p.wait() for p in combines]
        stats["rows_live"] = live[0] if n_chunks == 1 else torch.stack(live).sum()
        stats["rows_capacity"] = torch.tensor(cap)
        if "rows_dropped" not in stats:  # dropless: one zero for both (read only)
            stats["rows_dropped"] = stats["rows_padded"] = torch.zeros((), dtype=torch.int64, device=x_TH.device)
        return outs[0] if n_chunks == 1 else torch.cat(outs, dim=0)
