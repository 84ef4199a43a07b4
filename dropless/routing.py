"""DeepSeek-V3 router: sigmoid scores, bias-for-selection, group-limited top-k,
aux-loss-free bias balancing and the sequence-wise auxiliary loss.

Sources of the formulas (docs/design.md#the-router):

* Scores, selection bias, combine weights: DeepSeek-V3 technical report
  (arXiv:2412.19437) §2.1.2, eq. 12-16 — ``s = sigmoid(u·e)``, the bias
  ``b_i`` is added to ``s`` for the top-k choice only, the gate values are the
  unbiased ``s`` of the chosen experts normalised over the k of them.
  ``routed_scaling_factor`` (2.5 for V3) is the ``config.json`` field that the
  published model multiplies into the weights once.
* Group-limited (node-limited) routing, ``topk_method = "noaux_tc"``: the
  E experts are split into ``n_group`` groups; a group's score is the sum of
  its two highest biased scores; the ``topk_group`` best groups are kept and
  the others masked to -inf before the top-k (report §2.1.2 "node-limited
  routing"; config fields of the published model).
* Aux-loss-free balancing: report §2.1.2, ``b_i += γ·sign(mean load − load_i)``
  after each step, γ = ``bias_update_speed``.
* Sequence-wise auxiliary loss: report eq. 17-20,
  ``L = α Σ_i f_i P_i``, ``f_i = E/(k·T_seq) Σ_t 1[i ∈ topk_t]``,
  ``P_i = 1/T_seq Σ_t s'_{i,t}``, ``s' = s / Σ_j s_j`` over ALL E experts.

Shape letters as in docs/design.md#shapes-and-names: T tokens, H hidden, E routed experts, k experts
per token.

Counting rule (docs/design.md#the-router): each forward in training mode adds its per-expert row
counts into the buffer ``tokens_per_expert``, except a forward that runs
inside the autograd engine's backward, which is the recompute of activation
checkpointing (both ``use_reentrant=False``, whose recompute runs in a
saved-tensor hook, and ``use_reentrant=True``, whose recompute runs in the
checkpoint Function's backward). Grad mode is *not* the signal: the reentrant
checkpoint runs its first forward under ``no_grad``. An evaluation pass must
therefore put the model in ``eval()`` mode (the usual rule) to not be counted.

No host syncs in :meth:`Router.forward`: the finite check is
``torch._assert_async``, counts stay on the device. :meth:`Router.stats` and
:func:`update_router_biases` convert to Python numbers (once per step, for
logging) and say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dropless.config import ConfigError, ModelArgs
from dropless.ops.route_topk import group_limited_topk

__all__ = ["Router", "RouterOutput", "update_router_biases", "summed_router_counts", "apply_router_bias_updates",
           "in_backward_recompute"]

#: In the message of the non-finite logits error (``dropless-train`` maps it to exit status 3).
NONFINITE_LOGITS = "non-finite router logits"

# Guard of the top-k normalisation denominator (as DeepSeek's MoEGate): only
# matters if every chosen score underflows to 0.
_NORM_EPS = 1e-20
_TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")


@dataclass
class RouterOutput:
    """What :meth:`Router.forward` returns.

    Attributes:
        topk_idx_Tk: int64 [T, k], global expert ids of each token's choices,
            ordered by descending biased score.
        topk_weight_Tk: fp32 [T, k], combine weights (unbiased scores of the
            chosen experts, normalised over k if ``norm_topk_prob``, times
            ``routed_scaling_factor``); differentiable wrt ``x`` and ``weight``.
        scores_TE: fp32 [T, E], unbiased scores (sigmoid or softmax).
        aux_loss: fp32 0-dim, α-weighted sequence-wise balance loss (exact 0 in
            eval mode or when ``aux_loss_alpha == 0``).
        counts_E: int64 [E], routed rows per expert in this call, padding tokens
            excluded (exact at any T; these are balancing counts — a
            dispatcher that also moves padding tokens counts its own rows).
        seq_len, token_mask_T: what :meth:`Router.account` needs of the call.
    ``aux_loss`` and ``counts_E`` are None after ``forward(..., account=False)`` until
    :meth:`Router.account` fills them.
    """

    topk_idx_Tk: torch.Tensor
    topk_weight_Tk: torch.Tensor
    scores_TE: torch.Tensor
    aux_loss: torch.Tensor | None
    counts_E: torch.Tensor | None
    seq_len: int = 1
    token_mask_T: torch.Tensor | None = None


class _Fp32Logits(torch.autograd.Function):
    """``x_TH.float() @ weight_EH.float().T`` that saves ``x_TH`` in its own dtype.

    Autograd of ``F.linear(x.float(), w.float())`` would save the fp32 copy of ``x``
    (``T·H·4`` bytes: 0.22 GiB at T 8192, H 7168, twice the bf16 layer input, which the
    shared experts keep anyway). Backward re-casts it; the gradients are the same
    (the upcast is exact). On CUDA, 16-bit ``x`` and ``weight`` of one dtype go through
    ``torch.mm(..., out_dtype=torch.float32)`` (fp32 accumulation and output).

    Backward on CUDA with bf16 ``x`` and ``weight``: the fp32 ``dlogits`` is split into two bf16
    parts, ``hi = bf16(dlogits)``, ``lo = bf16(dlogits − hi)`` (16 significant bits together; bf16
    has fp32's exponent range), and both gradients come from bf16 tensor-core GEMMs with fp32
    accumulation over ``[hi | lo]`` (K = 2E): ``dx = [hi | lo] @ [w ; w]``, ``dw = hiᵀx + loᵀx``.
    They are rounded to bf16 once, as the fp32 path rounds them, and differ from it by at most
    one bf16 rounding (``tests/test_routing.py``, GPU). The fp32 GEMMs they replace are SIMT
    kernels (no fp32 tensor-core path without TF32).
    Elsewhere (CPU, fp16, fp32) the fp32 products as written below.
    """

    @staticmethod
    def forward(ctx, x_TH, weight_EH):
        ctx.save_for_backward(x_TH, weight_EH)
        if x_TH.is_cuda and x_TH.dtype == weight_EH.dtype and x_TH.dtype in (torch.bfloat16, torch.float16):
            # the 16-bit GEMM with fp32 accumulation and fp32 output: the same fp32 logits of the
            # same 16-bit values, without an fp32 copy of x and an fp32 GEMM
            return torch.mm(x_TH, weight_EH.t(), out_dtype=torch.float32)
        return F.linear(x_TH.float(), weight_EH.float())

    @staticmethod
    def backward(ctx, dlogits_TE):
        x_TH, weight_EH = ctx.saved_tensors
        dx = dw = None
        if dlogits_TE.is_cuda and x_TH.dtype == weight_EH.dtype == torch.bfloat16:
            hi = dlogits_TE.to(torch.bfloat16)
            d2_T2E = torch.cat([hi, (dlogits_TE - hi.float()).to(torch.bfloat16)], dim=1)  # dlogits ≈ hi + lo
            if ctx.needs_input_grad[0]:
                dx = d2_T2E @ torch.cat([weight_EH, weight_EH], dim=0)  # fp32 accumulation, one bf16 rounding
            if ctx.needs_input_grad[1]:
                p_2EH = torch.mm(d2_T2E.t(), x_TH, out_dtype=torch.float32)
                e = weight_EH.shape[0]
                dw = (p_2EH[:e] + p_2EH[e:]).to(torch.bfloat16)
            return dx, dw
        # Each operand is upcast from its transpose: traced, ``x.float()`` would be the forward's own
        # upcast (the common-subexpression pass merges the two), which inductor's partitioner then
        # saves in fp32 for this matmul instead of the 16-bit x it saves anyway (T·H·4 bytes a
        # layer, CPU; likewise the weight). The upcast of ``x.t()`` is another node, rebuilt here
        # from the saved x; the products are the same.
        if ctx.needs_input_grad[0]:
            dx = (dlogits_TE @ weight_EH.t().float().t()).to(x_TH.dtype)
        if ctx.needs_input_grad[1]:
            dw = (dlogits_TE.t() @ x_TH.t().float().t()).to(weight_EH.dtype)
        return dx, dw


def in_backward_recompute() -> bool:
    """True while the autograd engine runs a backward graph task on this thread.

    That is where activation checkpointing re-runs a forward (both
    ``use_reentrant`` modes of ``torch.utils.checkpoint``). A plain forward, even
    under ``torch.no_grad()``, returns False. Host-only (no device work).
    Under ``torch.compile`` it is False: the compiled graph runs the forward once, and
    AOTAutograd recomputes inside the backward graph without re-running this Python (a
    compiled router inside an eager checkpoint would count its recompute again).
    """
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    """DeepSeek-V3 gate of one MoE layer.

    Args:
        args: model config; reads ``hidden_size``, ``n_routed_experts`` (E),
            ``num_experts_per_tok`` (k), ``n_group``, ``topk_group``,
            ``topk_method``, ``scoring_func``, ``norm_topk_prob``,
            ``routed_scaling_factor``, ``aux_loss_alpha``, ``bias_update_speed``,
            ``initializer_range``.
        layer_id: decoder layer index; named in every error and the stats key.

    Parameters / buffers:
        weight: Parameter [E, H] (dtype of the model; logits are computed in fp32).
        e_score_correction_bias: fp32 [E] buffer, persistent (checkpointed),
            zeros at init; added to the scores for selection only.
        tokens_per_expert: int64 [E] buffer, persistent (so a resumed step keeps
            its partial counts); rows routed since the last :meth:`update_bias`,
            exact at any count (an fp32 counter stops counting at 2^24). A
            checkpoint holding the older fp32 counter loads (whole numbers are
            converted; anything else raises).
        The bias stays fp32 under ``module.to(dtype)`` / ``.half()``.

    Raises:
        ConfigError: from ``args.validate(layer=...)`` (E % n_group, topk_group >
            n_group, k larger than the kept groups hold, ...), or an unknown
            ``topk_method``.
    """

    _FP32_BUFFERS = ("e_score_correction_bias",)

    def __init__(self, args: ModelArgs, layer_id: int = 0) -> None:
        super().__init__()
        self.layer_name = f"layer {layer_id}"
        args.validate(layer=str(layer_id))
        if args.topk_method not in _TOPK_METHODS:
            raise ConfigError(
                f"topk_method={args.topk_method!r} (layer {layer_id}): must be one of "
                f"{_TOPK_METHODS} ('noaux_tc' is DeepSeek-V3's)"
            )
        self.layer_id = int(layer_id)
        self.dim = int(args.hidden_size)
        self.n_experts = int(args.n_routed_experts)
        self.topk = int(args.num_experts_per_tok)
        self.n_group = int(args.n_group)
        self.topk_group = int(args.topk_group)
        self.topk_method = args.topk_method
        self.scoring_func = args.scoring_func
        self.norm_topk_prob = bool(args.norm_topk_prob)
        self.routed_scaling_factor = float(args.routed_scaling_factor)
        self.aux_loss_alpha = float(args.aux_loss_alpha)
        self.bias_update_speed = float(args.bias_update_speed)
        self.init_std = float(args.initializer_range)

        self.weight = nn.Parameter(torch.empty(self.n_experts, self.dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(self.n_experts, dtype=torch.int64), persistent=True)
        #: raise on non-finite logits (True); False lets them through, for a caller that checks the
        #: loss itself and skips the step (the trainer's ``train.nonfinite=skip``)
        self.check_finite = True
        # last forward's device tensors, read by stats() (not model state)
        self._last_counts_E: torch.Tensor | None = None
        self._last_aux_loss: torch.Tensor | None = None
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """``weight ~ Normal(0, initializer_range)``; bias and counters to zero.

        The draw is made in fp32 on the CPU (``generator`` is a CPU generator;
        None = the global CPU RNG) and copied in, so the values do not depend on
        the weight's dtype or device. No-op on the meta device.
        """
        if self.weight.is_meta:
            return
        w = torch.empty(self.weight.shape, dtype=torch.float32).normal_(0.0, self.init_std, generator=generator)
        self.weight.copy_(w)
        self.e_score_correction_bias.zero_()
        self.tokens_per_expert.zero_()

    init_weights = reset_parameters

    def _apply(self, fn, recurse=True):  # keep the balancing buffers fp32
        saved = {n: self._buffers[n] for n in self._FP32_BUFFERS}
        super()._apply(fn, recurse)
        for n, old in saved.items():
            new = self._buffers[n]
            if new is not None and new.dtype != torch.float32:
                if old.is_meta or new.is_meta:
                    self._buffers[n] = torch.zeros(old.shape, dtype=torch.float32, device=new.device)
                else:  # re-derive from the fp32 value, not the down-cast one
                    self._buffers[n] = old.to(device=new.device, dtype=torch.float32)
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "tokens_per_expert"
        old = state_dict.get(key)
        if isinstance(old, torch.Tensor) and old.is_floating_point():  # a checkpoint of the fp32 counter
            state_dict[key] = _whole_counts(old, f"Router ({self.layer_name}): checkpoint entry {key!r}")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # --------------------------------------------------------------- checks
    def _check_inputs(self, x_TH: torch.Tensor, seq_len: int | None,
                      token_mask_T: torch.Tensor | None) -> int:
        """Shape/dtype checks (host-side only). Returns the sequence length.

        The layer's name is read only where an error is raised: under ``torch.compile`` a
        name read on the way would be guarded as a constant, one graph per layer."""
        if not isinstance(x_TH, torch.Tensor) or x_TH.dim() != 2:
            shape = tuple(x_TH.shape) if isinstance(x_TH, torch.Tensor) else type(x_TH).__name__
            raise ValueError(f"Router ({self.layer_name}): x_TH must be 2-D [T, H={self.dim}], got {shape}; "
                             "flatten batch and sequence first (x.view(-1, hidden_size))")
        T, H = x_TH.shape
        if H != self.dim:
            raise ValueError(f"Router ({self.layer_name}): x_TH has H={H} but hidden_size={self.dim}; "
                             "the router's hidden_size must match the model's")
        if not x_TH.is_floating_point():
            raise ValueError(f"Router ({self.layer_name}): x_TH must be a floating dtype, got {x_TH.dtype}")
        if seq_len is None:
            seq_len = T
        else:  # T = batch * seq_len; seq_len = 0 is an empty batch ([B, 0, H])
            seq_len = int(seq_len)
            if seq_len < 0 or (seq_len == 0 and T) or (seq_len and T % seq_len):
                raise ValueError(f"Router ({self.layer_name}): seq_len={seq_len} must divide T={T} "
                                 "(T = batch * seq_len; 0 only when T = 0)")
        if token_mask_T is not None:
            if token_mask_T.shape != (T,) or token_mask_T.dtype != torch.bool:
                raise ValueError(f"Router ({self.layer_name}): token_mask_T must be bool [T={T}], got "
                                 f"{token_mask_T.dtype} {tuple(token_mask_T.shape)}")
            if token_mask_T.device != x_TH.device:
                raise ValueError(f"Router ({self.layer_name}): token_mask_T on {token_mask_T.device}, "
                                 f"x_TH on {x_TH.device}; put both on one device")
        return max(seq_len, 1)

    # -------------------------------------------------------------- forward
    def _select(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """Biased, group-limited top-k (:func:`~dropless.ops.route_topk.group_limited_topk`). int64 [T, k]. No grad."""
        with torch.no_grad():
            return group_limited_topk(scores_TE.detach(), self.topk, self.n_group, self.topk_group, self.topk_method,
                                      bias_E=self.e_score_correction_bias.to(scores_TE.dtype))

    def forward(self, x_TH: torch.Tensor, seq_len: int | None = None,
                token_mask_T: torch.Tensor | None = None, account: bool = True) -> RouterOutput:
        """Route T tokens.

        Args:
            x_TH: [T, H] floating, any dtype (upcast to fp32 for the logits).
            seq_len: tokens per sequence for the sequence-wise aux loss
                (T = batch * seq_len; 0 when T = 0); None = the T tokens are one sequence.
                T = 0 is valid: empty outputs, zero counts, aux loss 0.
            token_mask_T: optional bool [T], False for padding tokens: they are
                still routed (their rows are well defined) but are left out of
                the aux loss and of the balancing counts.
            account: compute the counts and the aux loss here (:meth:`account`). False leaves
                them to the caller's later ``account(out)`` call: the MoE layer makes it after
                its expert GEMMs are queued, so that these small, host-bound kernels are
                launched while the GPU is busy rather than while it waits.

        Returns: :class:`RouterOutput`.

        Raises:
            ValueError: bad shape/dtype of ``x_TH``, ``seq_len`` or ``token_mask_T``
                (before any state changes).
            RuntimeError: non-finite router logits (``torch._assert_async``:
                raised at once on CPU, a device-side assert on GPU), before
                ``tokens_per_expert`` is touched; not with ``check_finite = False``.
        """
        seq_len = self._check_inputs(x_TH, seq_len, token_mask_T)
        with torch.autocast(device_type=x_TH.device.type, enabled=False):  # fp32 logits
            logits_TE = _Fp32Logits.apply(x_TH, self.weight)
        if self.check_finite:
            # compiled, one graph serves every layer: the layer's name would be guarded as a constant
            where = "Router (a compiled layer)" if torch.compiler.is_compiling() else f"Router ({self.layer_name})"
            # one fp64 sum is finite exactly when every logit is (it cannot overflow: T·E fp32 values), and
            # s - s == 0 exactly when s is finite: three small kernels, not isfinite's four passes over [T, E]
            total = logits_TE.detach().sum(dtype=torch.float64)
            torch._assert_async(
                (total - total) == 0,
                f"{where}: {NONFINITE_LOGITS} (NaN/Inf) — the "
                "input hidden states or the gate weight hold NaN/Inf; check the previous "
                "layer's output, the learning rate and the loss scale",
            )
        if self.scoring_func == "sigmoid":
            scores_TE = logits_TE.sigmoid()
        else:
            scores_TE = logits_TE.softmax(dim=-1)

        topk_idx_Tk = self._select(scores_TE)
        weight_Tk = scores_TE.gather(1, topk_idx_Tk)
        if self.norm_topk_prob:
            weight_Tk = weight_Tk / (weight_Tk.sum(dim=-1, keepdim=True) + _NORM_EPS)
        topk_weight_Tk = weight_Tk * self.routed_scaling_factor
        out = RouterOutput(topk_idx_Tk, topk_weight_Tk, scores_TE, None, None, seq_len, token_mask_T)
        return self.account(out) if account else out

    def account(self, out: RouterOutput) -> RouterOutput:
        """Fill ``out.counts_E`` and ``out.aux_loss`` of a ``forward(..., account=False)`` call; returns ``out``.

        Adds the counts into ``tokens_per_expert`` (training mode) and keeps them and the aux loss for
        :meth:`stats`, except inside an activation-checkpointing recompute (module docstring). Call it
        once per forward, in the same autograd context (the aux loss is differentiable wrt the scores).
        No host sync.
        """
        scores_TE, topk_idx_Tk, seq_len, token_mask_T = out.scores_TE, out.topk_idx_Tk, out.seq_len, out.token_mask_T
        T, E = scores_TE.shape
        with torch.no_grad():
            # selection one-hot [T, E] (a token meets an expert at most once), padding tokens zeroed
            chosen_TE = torch.zeros(T, E, dtype=torch.float32, device=scores_TE.device)
            chosen_TE.scatter_(1, topk_idx_Tk, 1.0)
            if token_mask_T is not None:
                chosen_TE.mul_(token_mask_T.unsqueeze(1).to(torch.float32))
            # exact integer counts: a column sum of 0/1 in fp64 (exact below 2^53 tokens); no atomic
            # histogram, whose T·k increments into E bins serialise on the bins
            counts_E = chosen_TE.sum(0, dtype=torch.float64).to(torch.int64)

        if self.training and self.aux_loss_alpha > 0 and T > 0:
            aux_loss = self._seq_aux_loss(scores_TE, chosen_TE, seq_len, token_mask_T)
        else:
            aux_loss = torch.zeros((), dtype=torch.float32, device=scores_TE.device)

        if not in_backward_recompute():
            if self.training:
                self.tokens_per_expert.add_(counts_E)
            self._last_counts_E = counts_E
            self._last_aux_loss = aux_loss.detach()
        out.aux_loss, out.counts_E = aux_loss, counts_E
        return out

    def _seq_aux_loss(self, scores_TE: torch.Tensor, chosen_TE: torch.Tensor, seq_len: int,
                      token_mask_T: torch.Tensor | None) -> torch.Tensor:
        """DeepSeek-V3 eq. 17-20, averaged over the sequences with >= 1 real token.

        ``chosen_TE`` is already zero on padding tokens. fp32 0-dim; the gradient
        flows through P (the normalised scores), f is a count.
        """
        T, E = scores_TE.shape
        B = T // seq_len
        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)   # s' over all E
        if token_mask_T is None:  # every sequence holds seq_len real tokens: the same sums, fewer kernels
            f_BE = chosen_TE.view(B, seq_len, E).sum(dim=1) * (E / self.topk) / seq_len
            P_BE = probs_TE.view(B, seq_len, E).sum(dim=1) / seq_len
            return self.aux_loss_alpha * (f_BE * P_BE).sum() / B
        m_T = token_mask_T.to(torch.float32)
        probs_TE = probs_TE * m_T.unsqueeze(1)
        n_tok_B = m_T.view(B, seq_len).sum(dim=1)
        denom_B1 = n_tok_B.clamp_min(1.0).unsqueeze(1)
        f_BE = chosen_TE.view(B, seq_len, E).sum(dim=1) * (E / self.topk) / denom_B1
        P_BE = probs_TE.view(B, seq_len, E).sum(dim=1) / denom_B1
        has_tok_B = (n_tok_B > 0).to(torch.float32)
        loss_B = (f_BE * P_BE).sum(dim=1) * has_tok_B
        return self.aux_loss_alpha * loss_B.sum() / has_tok_B.sum().clamp_min(1.0)

    # ------------------------------------------------------------ balancing
    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Aux-loss-free balancing step: ``bias += γ·sign(mean(load) − load)``.

        Args:
            counts_E: the whole optimizer step's per-expert rows (summed over
                micro-batches and data-parallel ranks), integer (or floating
                holding whole numbers); default: this router's
                ``tokens_per_expert`` (local only — use
                :func:`update_router_biases` to sum over ranks).
            keep: a 0-dim device tensor, 1 or 0 (any dtype): the step is applied (1)
                or skipped (0: the bias does not move, the counter is still reset),
                decided on the device (the trainer's non-finite skip) without a host sync.
        Returns: the int64 [E] load that was used (a copy, on the device).
        Resets ``tokens_per_expert`` to 0. No host sync. The sign is exact at any
        count: ``sign(mean − load_i) = sign(Σ_j load_j − E·load_i)`` in int64.
        """
        load_E = (self.tokens_per_expert if counts_E is None else counts_E).detach()
        if load_E.shape != (self.n_experts,):
            raise ValueError(f"Router ({self.layer_name}).update_bias: counts_E must be "
                             f"[E={self.n_experts}], got {tuple(load_E.shape)}")
        if load_E.is_floating_point():
            load_E = load_E.round()
        load_E = load_E.to(device=self.e_score_correction_bias.device, dtype=torch.int64, copy=True)
        direction_E = torch.sign(load_E.sum() - self.n_experts * load_E).to(torch.float32)
        if keep is not None:
            direction_E = direction_E * keep.to(torch.float32)
        self.e_score_correction_bias.add_(direction_E, alpha=self.bias_update_speed)
        self.tokens_per_expert.zero_()
        return load_E

    def stats(self) -> dict[str, float]:
        """Statistics of the last (non-recompute) forward of this layer.

        Keys: ``max_over_mean``, ``min_over_mean`` (per-expert rows over their
        mean; E and 0 at full imbalance, 1 when balanced), ``empty_experts``,
        ``tokens`` (routed rows), ``aux_loss``. Empty dict before any forward.
        Converts to Python floats: a host sync, for logging outside the hot path.
        """
        if self._last_counts_E is None:
            return {}
        out = _load_stats(self._last_counts_E.detach().cpu())
        out["aux_loss"] = float(self._last_aux_loss) if self._last_aux_loss is not None else 0.0
        return out

    def extra_repr(self) -> str:
        return (f"layer_id={self.layer_id}, dim={self.dim}, n_experts={self.n_experts}, "
                f"topk={self.topk}, n_group={self.n_group}, topk_group={self.topk_group}, "
                f"scoring_func={self.scoring_func}")


def _whole_counts(counts: torch.Tensor, what: str) -> torch.Tensor:
    """A floating count vector as int64; raises ValueError unless it holds whole numbers >= 0."""
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()) or not torch.equal(counts, counts.round()):
        raise ValueError(f"{what}: per-expert counts must be whole numbers >= 0, got {counts.tolist()}; "
                         "this is not a router counter (was the checkpoint written by dropless?)")
    return counts.to(torch.int64)


def _load_stats(counts_E: torch.Tensor) -> dict[str, float]:
    """Load statistics of one layer from a CPU int64 count vector (``tokens``, ``empty_experts``: ints)."""
    total = int(counts_E.sum())
    n = max(counts_E.numel(), 1)
    return {  # max / mean = max·E / total, in float64
        "max_over_mean": int(counts_E.max()) * n / total if total > 0 else 0.0,
        "min_over_mean": int(counts_E.min()) * n / total if total > 0 else 0.0,
        "empty_experts": int((counts_E == 0).sum()),
        "tokens": total,
    }


@torch.no_grad()
def summed_router_counts(routers: list[Router], group: Any = None) -> torch.Tensor:
    """int64 ``[Σ E_l]``: every router's ``tokens_per_expert``, concatenated in order, summed over ``group``.

    ONE all-reduce (SUM, int64: exact) when ``torch.distributed`` is initialised and ``group``
    has > 1 rank; no host sync. Every rank must call it with the same routers. The counters
    are not reset (:func:`apply_router_bias_updates` does).
    """
    flat = torch.cat([r.tokens_per_expert.to(torch.int64) for r in routers])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    return flat


@torch.no_grad()
def apply_router_bias_updates(routers: list[Router], summed_flat: torch.Tensor, keep: torch.Tensor | None = None
                              ) -> list[torch.Tensor]:
    """Move every router's bias once with its slice of ``summed_flat`` (from :func:`summed_router_counts`).

    Calls :meth:`Router.update_bias` per router (which resets its counter; ``keep``: its 0-dim
    device flag, 0 = leave every bias where it is); returns the int64 ``[E_l]`` loads used. No host sync.

    Raises:
        ValueError: ``summed_flat`` does not hold ``Σ E_l`` counts.
    """
    sizes = [r.n_experts for r in routers]
    if summed_flat.numel() != sum(sizes):
        raise ValueError(f"apply_router_bias_updates: {summed_flat.numel()} counts for routers of {sizes} experts")
    return [r.update_bias(load_E, keep) for r, load_E in zip(routers, summed_flat.reshape(-1).split(sizes))]


@torch.no_grad()
def update_router_biases(model: nn.Module, group: Any = None) -> dict[str, dict]:
    """Once per optimizer step: sum the counts over ranks, move every bias once, reset.

    Finds every :class:`Router` in ``model``; all-reduces (SUM) all their
    ``tokens_per_expert`` in ONE flattened collective over ``group`` (when
    ``torch.distributed`` is initialised and the group has > 1 rank; pass the
    group over which the routers see different tokens — normally all ranks);
    applies :meth:`Router.update_bias` with the summed counts; resets the
    counters. Every rank must call it (the same model on every rank).

    Returns: ``{"layer{layer_id}": {"counts": [E ints], "max_over_mean",
    "min_over_mean", "empty_experts", "tokens", "aux_loss"}}`` — the step's
    counts summed over micro-batches and ranks (exact integers: the all-reduce
    is in int64), and this rank's last aux loss.
    Host sync: one device-to-host copy of all layers' counts, for logging.

    Raises:
        ValueError: two routers share a ``layer_id`` (the stats would collide).
    """
    routers: list[tuple[str, Router]] = [(n, m) for n, m in model.named_modules() if isinstance(m, Router)]
    if not routers:
        return {}
    seen: dict[int, str] = {}
    for name, r in routers:
        if r.layer_id in seen:
            raise ValueError(f"update_router_biases: routers {seen[r.layer_id]!r} and {name!r} both have "
                             f"layer_id={r.layer_id}; give each MoE layer its own layer_id")
        seen[r.layer_id] = name

    rs = [r for _, r in routers]
    loads = apply_router_bias_updates(rs, summed_router_counts(rs, group))
    aux = [r._last_aux_loss if r._last_aux_loss is not None else torch.zeros((), device=load_E.device)
           for r, load_E in zip(rs, loads)]
    # one host copy for all layers: the int64 counts, then the float64 aux losses' bits
    aux64 = torch.stack([a.to(loads[0].device, torch.float64) for a in aux]).view(torch.int64)
    host = torch.cat([torch.cat(loads), aux64]).cpu()
    n_loads = sum(l.numel() for l in loads)
    aux_host = host[n_loads:].view(torch.float64)
    out: dict[str, dict] = {}
    offset = 0
    for i, (_, r) in enumerate(routers):
        c = host[offset: offset + r.n_experts]
        offset += r.n_experts
        s = _load_stats(c)
        s["counts"] = c.tolist()
        s["aux_loss"] = float(aux_host[i])
        out[f"layer{r.layer_id}"] = s
    return out
