"""The DeepSeek-V3-shaped decoder: embedding, MLA + (dense | MoE) blocks, head.

```
tokens_BS ─ tok_embeddings ─ h_BSH
  for each layer i:  h += attention(attention_norm(h))
                     h += (moe if i in args.moe_layer_ids() else feed_forward)(ffn_norm(h))
  ─ norm ─ output ─ logits_BSV (fp32)                     model(tokens_BS)
                 ─ loss: mean CE + Σ MoE aux losses      model.loss(tokens_BS, targets_BS)
```

Layers ``0 .. first_k_dense_replace-1`` are dense SwiGLU (``intermediate_size``);
the rest (every ``moe_layer_freq``-th) hold :class:`dropless.moe.MoE`
(DeepSeek-V3 technical report, section 2). The output head is untied from the
embedding (``tie_word_embeddings`` false, as published). With
``num_nextn_predict_layers = D > 0`` the model also holds ``mtp``, the D multi-token-prediction
modules of :mod:`dropless.model.mtp` (their loss: :meth:`Transformer.mtp_loss`; the forward
does not run them).

Shape letters: B batch, S sequence, H ``hidden_size``, V ``vocab_size``.
"""

from __future__ import annotations

import zlib
from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dropless.config import ModelArgs
from dropless.mlp import FeedForward
from dropless.model.attention import MLA
from dropless.model.loss import linear_cross_entropy
from dropless.model.mtp import MultiTokenPrediction, dense_head_loss, mtp_block_is_moe, mtp_layer_ids
from dropless.model.norm import RMSNorm
from dropless.model.rope import rope_cos_sin
from dropless.moe import MoE


class LossOutput(NamedTuple):
    """:meth:`Transformer.loss`: 0-dim tensors, fp32 (float64 in a float64 model).

    ``loss = ce + aux + mtp`` is what to backpropagate; ``ce`` is the mean next-token
    cross-entropy (nats per target token), ``aux`` the sum over MoE layers of their
    sequence-wise aux losses, ``mtp`` the multi-token-prediction loss
    (:meth:`Transformer.mtp_loss`, its weight included; 0 without MTP modules or when
    ``mtp_loss_weight`` is 0).
    """

    loss: torch.Tensor
    ce: torch.Tensor
    aux: torch.Tensor
    mtp: torch.Tensor | None = None


class Block(nn.Module):
    """One decoder layer: pre-norm MLA and pre-norm FFN, each with a residual.

    Args:
        args: model config.
        layer_id: index of this layer in the stack (decides dense vs MoE through
            ``args.moe_layer_ids()``).
        dispatcher: the MoE layer's dispatcher (None = local); ignored by a
            dense layer.
        moe: force an MoE (True) or dense (False) FFN; None decides by
            ``args.moe_layer_ids()`` (the MTP blocks, past ``num_hidden_layers``, pass it).

    Submodules: ``attention_norm``, ``attention`` (:class:`MLA`), ``ffn_norm``,
    and either ``moe`` (:class:`dropless.moe.MoE`, ``moe_enabled`` True) or
    ``feed_forward`` (:class:`FeedForward` of width ``intermediate_size``).
    """

    def __init__(self, args: ModelArgs, layer_id: int, dispatcher=None, moe: bool | None = None) -> None:
        super().__init__()
        self.layer_id = int(layer_id)
        self.attention_norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.attention = MLA(args)
        self.ffn_norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.moe_enabled = self.layer_id in args.moe_layer_ids() if moe is None else bool(moe)
        if self.moe_enabled:
            self.moe = MoE(args, self.layer_id, dispatcher)
        else:
            self.feed_forward = FeedForward(args.hidden_size, args.intermediate_size)

    def forward(self, x_BSH: torch.Tensor, rope_cos_SP: torch.Tensor,
                rope_sin_SP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x_BSH`` [B, S, H] -> ``(h_BSH, aux_loss)``; ``rope_*_SP`` [S, qk_rope_head_dim/2].

        ``aux_loss``: this layer's sequence-wise aux loss (fp32 0-dim, see
        :attr:`dropless.moe.MoE.aux_loss`), None for a dense layer. It is returned rather
        than read from the MoE layer so that it stays connected to the graph when the block
        runs under ``torch.utils.checkpoint``.
        """
        a_BSH = self.attention(self.attention_norm(x_BSH), rope_cos_SP, rope_sin_SP)
        h_BSH, n_BSH = self.ffn_norm.forward_add(x_BSH, a_BSH)  # h = x + a, n = ffn_norm(h): one kernel on CUDA
        if self.moe_enabled:
            y_BSH, aux_loss = self.moe(n_BSH, return_aux=True)
            return h_BSH + y_BSH, aux_loss
        return h_BSH + self.feed_forward(n_BSH), None


class Transformer(nn.Module):
    """DeepSeek-V3-shaped causal language model.

    Args:
        args: model config (validated here; :class:`ConfigError` on a bad field).
        dispatcher_factory: ``dispatcher_factory(layer_id) -> Dispatcher`` builds
            each MoE layer's dispatcher; None gives every MoE layer its default
            (local, EP = 1). Called only for MoE layers, in layer order.
        activation_checkpointing: recompute each block in backward
            (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``);
            may be toggled later through the attribute of the same name.

    Submodules: ``tok_embeddings`` [V, H], ``layers`` (``nn.ModuleDict`` keyed
    ``"0" .. str(L-1)``), ``norm``, ``output`` (``nn.Linear(H, V)``, no bias), and
    ``mtp`` (:class:`~dropless.model.mtp.MultiTokenPrediction`, its blocks numbered
    ``L .. L+D-1``) or None when ``num_nextn_predict_layers`` is 0.

    Builds on the meta device (``with torch.device("meta"): Transformer(args)``)
    without allocating; materialise with ``to_empty(device=...)`` and then
    :meth:`init_weights`.

    Raises:
        ConfigError: ``args`` fails :meth:`ModelArgs.validate` (e.g. ``tie_word_embeddings``
            true: DeepSeek-V3's head is untied; tying is not supported).
    """

    def __init__(self, args: ModelArgs,
                 dispatcher_factory: Callable[[int], object] | None = None,
                 activation_checkpointing: bool = False) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.yarn = args.yarn()  # None: plain RoPE
        self.activation_checkpointing = bool(activation_checkpointing)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        moe_ids = set(args.moe_layer_ids())
        self.layers = nn.ModuleDict()
        for layer_id in range(args.num_hidden_layers):
            dispatcher = None
            if layer_id in moe_ids and dispatcher_factory is not None:
                dispatcher = dispatcher_factory(layer_id)
            self.layers[str(layer_id)] = Block(args, layer_id, dispatcher)
        self.norm = RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.output = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.mtp = None
        if args.num_nextn_predict_layers > 0:
            blocks = []
            for layer_id in mtp_layer_ids(args):
                moe = mtp_block_is_moe(args, layer_id)
                dispatcher = dispatcher_factory(layer_id) if moe and dispatcher_factory is not None else None
                blocks.append(Block(args, layer_id, dispatcher, moe=moe))
            self.mtp = MultiTokenPrediction(args, blocks)

    # ------------------------------------------------------------------ forward
    def forward(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor | None = None, *,
                ignore_index: int = -100, loss_impl: str = "torch"):
        """Next-token logits, or the training loss when ``targets_BS`` is given.

        Args:
            tokens_BS: [B, S] int64 token ids in ``[0, vocab_size)``.
            targets_BS: None, or [B, S] int64 target ids (``ignore_index`` where no target).
            ignore_index, loss_impl: see :meth:`loss`.

        Returns:
            without targets, ``logits_BSV``: [B, S, V] float32 (float64 if the model runs in
            float64); with targets, :class:`LossOutput` (see :meth:`loss`).

        Raises:
            ValueError: ``tokens_BS`` is not 2-D, or S > ``max_position_embeddings``.
        """
        h_BSH, aux_loss = self._hidden_states(tokens_BS)
        if targets_BS is None:
            logits_BSV = self.output(h_BSH)
            return logits_BSV.to(torch.promote_types(logits_BSV.dtype, torch.float32))
        return self._head_loss(h_BSH, aux_loss, tokens_BS, targets_BS, ignore_index, loss_impl)

    def loss(self, tokens_BS: torch.Tensor, targets_BS: torch.Tensor, *, ignore_index: int = -100,
             loss_impl: str = "torch") -> "LossOutput":
        """The loss to backpropagate: mean next-token cross-entropy + Σ of the MoE layers' aux losses.

        Every factor the caller puts on ``.loss`` (``1/grad_accum``, a loss scale) scales the
        aux losses' gradients too (docs/design.md#the-router: the effective α does not depend on
        how a step is split). Runs through ``self(...)``, so FSDP2 and other module
        wrappers see the call.

        Args:
            tokens_BS: [B, S] int64 input ids. targets_BS: [B, S] int64 target ids.
            ignore_index: target id that contributes no loss (the mean is over the others).
            loss_impl: ``"torch"`` (chunked linear cross-entropy, any device) or
                ``"liger"`` (Liger-Kernel's fused linear cross-entropy, CUDA); see
                :mod:`dropless.model.loss`.

        Returns:
            :class:`LossOutput` ``(loss, ce, aux)``, 0-dim tensors; ``ce`` and ``aux`` are
            the parts of ``loss`` (for logging; ``aux`` is 0 in eval mode).
        """
        return self(tokens_BS, targets_BS, ignore_index=ignore_index, loss_impl=loss_impl)

    def rope_tables(self, seq_len: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~dropless.model.rope.rope_cos_sin` for ``seq_len`` positions on ``h``'s device
        (fp32; fp64 for a float64 model): ``(cos_SP, sin_SP)``, [S, qk_rope_head_dim/2].

        Built once per (S, device, dtype) and kept (the tables depend on nothing else), so a
        step does not rebuild them with a handful of small kernels per forward. Raises what
        ``rope_cos_sin`` raises (S beyond ``max_position_embeddings``).
        """
        dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
        key = (int(seq_len), h.device, dtype)
        cache = self.__dict__.setdefault("_rope_cache", {})
        if key not in cache:
            cache[key] = rope_cos_sin(
                int(seq_len), self.args.qk_rope_head_dim, self.args.rope_theta,
                max_position_embeddings=self.args.max_position_embeddings, yarn=self.yarn,
                device=h.device, dtype=dtype,
            )
        return cache[key]

    def _hidden_states(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens_BS`` -> (final-norm hidden states [B, S, H], Σ aux losses fp32 0-dim)."""
        if tokens_BS.dim() != 2:
            raise ValueError(f"Transformer.forward: tokens must be [batch, seq], "
                             f"got shape {tuple(tokens_BS.shape)}")
        seq_len = tokens_BS.shape[1]
        h_BSH = self.tok_embeddings(tokens_BS)
        cos_SP, sin_SP = self.rope_tables(seq_len, h_BSH)
        aux_loss = torch.zeros((), dtype=torch.float32, device=h_BSH.device)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.layers.values():
            if recompute:
                h_BSH, aux = checkpoint(block, h_BSH, cos_SP, sin_SP, use_reentrant=False)
            else:
                h_BSH, aux = block(h_BSH, cos_SP, sin_SP)
            if aux is not None:
                aux_loss = aux_loss + aux
        return self.norm(h_BSH), aux_loss

    def _head_loss(self, h_BSH: torch.Tensor, aux_loss: torch.Tensor, tokens_BS: torch.Tensor,
                   targets_BS: torch.Tensor, ignore_index: int, loss_impl: str) -> "LossOutput":
        """Mean cross-entropy of the output head on ``h_BSH`` (chunked: no [B, S, V] logits)
        + ``aux_loss`` + the MTP loss (where the model has MTP modules and a non-zero weight)."""
        if targets_BS.shape != h_BSH.shape[:2]:
            raise ValueError(f"Transformer.loss: targets {tuple(targets_BS.shape)} must match the "
                             f"tokens' [batch, seq] {tuple(h_BSH.shape[:2])}")

        def head_loss(hn, labels):
            return linear_cross_entropy(hn, self.output.weight, labels, ignore_index=ignore_index, impl=loss_impl)

        ce = head_loss(h_BSH, targets_BS)
        loss = ce + aux_loss
        mtp = None
        if self.mtp is not None and self.args.mtp_loss_weight > 0:
            mtp = self.mtp_loss(h_BSH, tokens_BS, targets_BS, head_loss=head_loss)
            loss = loss + mtp
        return LossOutput(loss, ce, aux_loss, mtp)

    def mtp_loss(self, h_BSH: torch.Tensor, tokens_BS: torch.Tensor, labels_BS: torch.Tensor,
                 head_loss=None) -> torch.Tensor:
        """The multi-token-prediction loss ``mtp_loss_weight / D · Σ_k CE_k`` to add to the
        main loss (DeepSeek-V3 §2.2; :class:`~dropless.model.mtp.MultiTokenPrediction`).

        Args:
            h_BSH: the final hidden states of the same forward (the output of ``self.norm``,
                the head's input), [B, S, H].
            tokens_BS: that forward's input tokens; labels_BS: its targets (``t_{i+1}``).
            head_loss: ``head_loss(hn_BnH, labels_Bn) -> mean CE`` of ``self.output``
                (e.g. a fused linear cross-entropy); None: logits in fp32, then
                :func:`torch.nn.functional.cross_entropy`.
        Returns: 0-dim fp32 (fp64 in fp64) loss; the MTP blocks' aux losses are in it (or
            ride on its backward, where the MoE layer attaches them itself).
        Raises:
            ValueError: the model has no MTP module (``num_nextn_predict_layers`` is 0), or
                S <= D.
        """
        if self.mtp is None:
            raise ValueError("mtp_loss: the model has no MTP module; build it with "
                             "num_nextn_predict_layers >= 1")
        cos_SP, sin_SP = self.rope_tables(tokens_BS.shape[1], h_BSH)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        loss, _ = self.mtp(h_BSH, tokens_BS, labels_BS, self.tok_embeddings,
                           head_loss or dense_head_loss(self.output), cos_SP, sin_SP, recompute=recompute)
        return loss

    # ------------------------------------------------------------ parameters
    def blocks(self) -> list[nn.Module]:
        """Every decoder layer: ``layers`` in order, then the MTP blocks."""
        return list(self.layers.values()) + (self.mtp.blocks() if self.mtp is not None else [])

    def moe_layers(self) -> list[nn.Module]:
        """The :class:`dropless.moe.MoE` modules, in layer order (the MTP blocks' last)."""
        return [block.moe for block in self.blocks() if block.moe_enabled]

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters of the routed experts (``MoE.experts`` of every MoE layer)."""
        params: list[nn.Parameter] = []
        seen: set[int] = set()
        for moe in self.moe_layers():
            for p in moe.experts.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def non_expert_parameters(self) -> list[nn.Parameter]:
        """Every parameter not in :meth:`expert_parameters` (attention, norms,
        dense FFNs, routers, shared experts, embedding, head)."""
        expert_ids = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in expert_ids]

    # ------------------------------------------------------------------- init
    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every weight deterministically.

        Linear weights and the embedding: Normal(0, ``initializer_range``);
        RMSNorm weights: ones (the DeepSeek-V3 / HF ``_init_weights`` scheme).
        Each tensor draws from its own CPU generator seeded from ``(seed, its
        qualified name)``, in fp32, and is then copied to the parameter's
        device and dtype: the values do not depend on the device, the dtype
        (up to rounding), the order of initialisation or FSDP2 sharding
        (a DTensor gets its local shard of the same full tensor). MoE layers
        initialise themselves through ``MoE.init_weights(layer_seed)``, with
        ``layer_seed`` derived from ``(seed, "layers.<i>.moe")``.
        Parameters on the meta device are left alone.

        Args:
            seed: base seed; None uses ``args.seed``.
        """
        seed = self.args.seed if seed is None else int(seed)
        std = self.args.initializer_range
        moe_param_ids: set[int] = set()
        for block in self.blocks():
            if block.moe_enabled:
                moe_param_ids.update(id(p) for p in block.moe.parameters())
                block.moe.init_weights(derive_seed(seed, f"layers.{block.layer_id}.moe"))
        norm_param_ids = {id(m.weight) for m in self.modules() if isinstance(m, RMSNorm)}
        for name, param in self.named_parameters():
            if id(param) in moe_param_ids:
                continue
            if id(param) in norm_param_ids:
                param.fill_(1.0)
                continue
            _fill_normal_(param, std, derive_seed(seed, _canonical_name(name)))

    def extra_repr(self) -> str:
        a = self.args
        return (f"layers={a.num_hidden_layers}, moe_layers={a.num_moe_layers}, "
                f"hidden={a.hidden_size}, vocab={a.vocab_size}, "
                f"activation_checkpointing={self.activation_checkpointing}")


# ---------------------------------------------------------------------- seeds
def derive_seed(seed: int, name: str) -> int:
    """A 63-bit seed from a base seed and a name (CRC32 of the name; stable
    across processes and Python versions, unlike ``hash``)."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _canonical_name(name: str) -> str:
    """Drop wrapper prefixes that ``torch.compile`` / checkpoint wrappers insert."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _fill_normal_(param: torch.Tensor, std: float, seed: int) -> None:
    """Fill ``param`` with Normal(0, std) drawn on the CPU from ``seed``."""
    if param.is_meta:
        return
    gen = torch.Generator(device="cpu").manual_seed(seed)
    full = torch.empty(tuple(param.shape), dtype=torch.float32).normal_(0.0, std, generator=gen)
    _copy_full_(param, full)


def _copy_full_(param: torch.Tensor, full_cpu: torch.Tensor) -> None:
    """Copy a full (unsharded) CPU tensor into ``param``, which may be a DTensor."""
    try:
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = None
    if DTensor is not None and isinstance(param, DTensor):
        mesh = param.device_mesh
        full = full_cpu.to(device=mesh.device_type, dtype=param.dtype)
        # Every rank holds the same full tensor: take the local shard, no communication.
        param.copy_(distribute_tensor(full, mesh, param.placements, src_data_rank=None))
    else:
        param.copy_(full_cpu.to(device=param.device, dtype=param.dtype))
