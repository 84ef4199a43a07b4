"""Multi-token prediction (MTP), DeepSeek-V3 technical report (arXiv:2412.19437) section 2.2.

``D = num_nextn_predict_layers`` sequential modules; module ``k`` (1-based) predicts the token
``k + 1`` places ahead of each position. With ``t`` the input tokens and ``h⁰`` the main
model's final hidden states (the output of its final norm, the output head's input):

```
h'ᵏ_i = eh_proj( [ enorm(Emb(t_{i+k})) ; hnorm(hᵏ⁻¹_i) ] )        i = 0 .. S-k-1
hᵏ    = block_k(h'ᵏ)                                               one decoder layer, causal
Pᵏ_i  = softmax(head(head_norm(hᵏ_i)))   predicts t_{i+k+1}
L_MTP = mtp_loss_weight / D · Σ_k CE(Pᵏ, t_{k+1 ..})               (report eq. 25)
```

``Emb`` and ``head`` are the main model's embedding and output head (shared, report §2.2);
``enorm``, ``hnorm``, ``eh_proj``, the block and ``head_norm`` belong to the module. The
concatenation puts the embedding first, as the released DeepSeek-V3 weights are laid out
(Hugging Face layer ``num_hidden_layers + k - 1``: ``enorm``, ``hnorm``, ``eh_proj``
``[H, 2H]``, ``shared_head.norm``; vLLM's and SGLang's MTP modules read them that way).
The block is an MoE layer when its layer index ``num_hidden_layers + k - 1`` is one
(``>= first_k_dense_replace``, on the ``moe_layer_freq`` grid), as in the released model.

Shape letters: B batch, S sequence, H ``hidden_size``, V ``vocab_size``, n = S - k.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dropless.config import ModelArgs
from dropless.model.norm import RMSNorm


def mtp_layer_ids(args: ModelArgs) -> list[int]:
    """Layer indices of the MTP blocks: ``num_hidden_layers + k`` for k = 0 .. D-1 (the
    Hugging Face layer index of each module's weights)."""
    return [args.num_hidden_layers + k for k in range(args.num_nextn_predict_layers)]


def mtp_block_is_moe(args: ModelArgs, layer_id: int) -> bool:
    """Whether the MTP block at ``layer_id`` is an MoE layer (the rule of
    :meth:`ModelArgs.moe_layer_ids` extended past ``num_hidden_layers``)."""
    return layer_id >= args.first_k_dense_replace and layer_id % max(args.moe_layer_freq, 1) == 0


class MTPModule(nn.Module):
    """One MTP depth: ``enorm``, ``hnorm``, ``eh_proj`` (``nn.Linear(2H, H)``, weight [H, 2H],
    columns: embedding half first), ``block`` (a decoder layer), ``head_norm``.

    Args:
        args: model config (``hidden_size``, ``rms_norm_eps``).
        block: the decoder layer of this depth (built by the caller: a
            :class:`dropless.model.transformer.Block` with its layer index).
    """

    def __init__(self, args: ModelArgs, block: nn.Module) -> None:
        super().__init__()
        H = args.hidden_size
        self.enorm = RMSNorm(H, eps=args.rms_norm_eps)
        self.hnorm = RMSNorm(H, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = block
        self.head_norm = RMSNorm(H, eps=args.rms_norm_eps)

    def forward(self, emb_BnH: torch.Tensor, h_BnH: torch.Tensor, rope_cos_nP: torch.Tensor,
                rope_sin_nP: torch.Tensor, recompute: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hᵏ [B, n, H], aux)`` from the embeddings of ``t_{i+k}`` and ``hᵏ⁻¹`` (both
        [B, n, H]); ``aux`` is the block's aux loss when the block returns ``(h, aux)``, else None."""
        x_BnH = self.eh_proj(torch.cat([self.enorm(emb_BnH), self.hnorm(h_BnH)], dim=-1))
        if recompute:
            out = checkpoint(self.block, x_BnH, rope_cos_nP, rope_sin_nP, use_reentrant=False)
        else:
            out = self.block(x_BnH, rope_cos_nP, rope_sin_nP)
        return out if isinstance(out, tuple) else (out, None)


HeadLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``head_loss(hn_BnH, labels_Bn) -> mean cross-entropy`` of the output head on normed states."""


class MultiTokenPrediction(nn.Module):
    """The ``D`` MTP modules (``layers``: ``nn.ModuleList`` of :class:`MTPModule`) and their loss.

    Args:
        args: model config (``num_nextn_predict_layers`` = D > 0, ``mtp_loss_weight``).
        blocks: D decoder layers, one per depth, in depth order.
    Raises:
        ValueError: ``len(blocks) != num_nextn_predict_layers``.
    """

    def __init__(self, args: ModelArgs, blocks: list[nn.Module]) -> None:
        super().__init__()
        if len(blocks) != args.num_nextn_predict_layers or not blocks:
            raise ValueError(f"MultiTokenPrediction: {len(blocks)} blocks given for "
                             f"num_nextn_predict_layers={args.num_nextn_predict_layers} (need one per depth, >= 1)")
        self.loss_weight = float(args.mtp_loss_weight)
        self.layers = nn.ModuleList([MTPModule(args, b) for b in blocks])

    def blocks(self) -> list[nn.Module]:
        """The decoder layers of the depths, in order."""
        return [m.block for m in self.layers]

    def forward(self, h_BSH: torch.Tensor, tokens_BS: torch.Tensor, labels_BS: torch.Tensor,
                embed: nn.Embedding, head_loss: HeadLoss, rope_cos_SP: torch.Tensor,
                rope_sin_SP: torch.Tensor, recompute: bool = False
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The weighted MTP loss and the per-depth cross-entropies.

        Args:
            h_BSH: the main model's final hidden states ``h⁰`` (after its final norm).
            tokens_BS: the main model's input tokens ``t_0 .. t_{S-1}`` (int64).
            labels_BS: the main model's targets (``labels[i] = t_{i+1}``; ``-100`` ignored,
                as in :func:`torch.nn.functional.cross_entropy`). Depth k is scored on
                ``labels[:, k:]``.
            embed: the main model's embedding (shared).
            head_loss: mean cross-entropy of the shared output head on ``head_norm(hᵏ)``.
            rope_cos_SP, rope_sin_SP: the main model's rotation tables [S, Dr/2] (depth k
                uses the first S - k rows).
            recompute: activation-checkpoint each depth's block.
        Returns:
            ``(mtp_loss_weight / D · Σ_k CE_k + Σ_k aux_k, [CE_1 .. CE_D])``, 0-dim fp32 (fp64
            in fp64); ``aux_k`` is block k's aux loss where the block returns one (a block that
            returns only ``h`` attaches it to the backward itself).
        Raises:
            ValueError: S <= D (depth D would score no position), or mismatched shapes.
        """
        B, S, _ = h_BSH.shape
        D = len(self.layers)
        if tokens_BS.shape != (B, S) or labels_BS.shape != (B, S):
            raise ValueError(f"MTP loss: tokens {tuple(tokens_BS.shape)} and labels {tuple(labels_BS.shape)} "
                             f"must both be [B, S] = [{B}, {S}] like the hidden states")
        if S <= D:
            raise ValueError(f"MTP loss: sequence length {S} leaves no position for depth {D} "
                             f"(num_nextn_predict_layers={D}); use sequences longer than {D}")
        losses, aux = [], []
        h_prev = h_BSH
        for k, module in enumerate(self.layers, start=1):
            n = S - k
            h_prev, aux_k = module(embed(tokens_BS[:, k:]), h_prev[:, :n], rope_cos_SP[:n], rope_sin_SP[:n],
                                   recompute=recompute)
            losses.append(head_loss(module.head_norm(h_prev), labels_BS[:, k:]))
            if aux_k is not None:
                aux.append(aux_k)
        total = self.loss_weight / D * torch.stack(losses).sum()
        for a in aux:
            total = total + a.to(total.dtype)
        return total, losses


def dense_head_loss(head: nn.Linear) -> HeadLoss:
    """``head_loss`` computing the logits with ``head`` in at least fp32 and a mean
    :func:`~torch.nn.functional.cross_entropy` (materialises ``[B, n, V]`` logits)."""

    def loss(hn_BnH: torch.Tensor, labels_Bn: torch.Tensor) -> torch.Tensor:
        logits = head(hn_BnH)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.flatten(0, 1), labels_Bn.reshape(-1))

    return loss
