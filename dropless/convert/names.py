"""Which Hugging Face DeepSeek-V3 tensor is which dropless tensor, and how it is laid out.

One :class:`HFTensor` per tensor of the Hugging Face format (``model.safetensors.index.json``'s
names), in the order the released files list them. Each says which dropless state-dict entry
(:class:`~dropless.model.Transformer` FQN) it belongs to and how:

=============  ===========================================  ==================================
kind           Hugging Face tensor                          dropless
=============  ===========================================  ==================================
``copy``       same shape                                   the whole tensor
``gate``       ``mlp.experts.{j}.gate_proj.weight`` [I, H]  ``moe.experts.w13[j, :, :I]`` (ᵀ)
``up``         ``mlp.experts.{j}.up_proj.weight`` [I, H]    ``moe.experts.w13[j, :, I:]`` (ᵀ)
``down``       ``mlp.experts.{j}.down_proj.weight`` [H, I]  ``moe.experts.w2[j]`` [I, H] (ᵀ)
``shared``     a copy the format stores twice: the MTP      ``tok_embeddings.weight`` /
               layer's ``embed_tokens`` / ``shared_head``   ``output.weight`` (written on
               ``.head``                                    export, not read on import)
=============  ===========================================  ==================================

(``j`` is the global expert index; ``w13`` is ``[e, H, 2I]`` with gate in the first ``I``
columns, ``w2`` is ``[e, I, H]``: :class:`dropless.experts.GroupedExperts`.)

RoPE rows: dropless rotates interleaved pairs ``(2j, 2j+1)`` (:mod:`dropless.model.rope`).
transformers' ``DeepseekV3Attention`` with ``rope_interleave`` true (the released layout)
rotates the same pairs, so the rows map as they are. With ``rope_interleave`` false it rotates
``(j, j + Dr/2)`` (``rotate_half``), and the rope rows of ``q_proj`` / ``q_b_proj`` (per head,
after the ``qk_nope_head_dim`` rows) and of ``kv_a_proj_with_mqa`` (after the
``kv_lora_rank`` rows) are permuted by :func:`rope_row_permutation` on import
(``rope`` = ``"q"`` / ``"kv"`` marks them). Export always writes the interleaved layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dropless.config import ModelArgs
from dropless.model.mtp import mtp_block_is_moe, mtp_layer_ids

__all__ = ["HFTensor", "hf_tensors", "rope_row_permutation", "local_hf_tensors"]


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the Hugging Face format.

    Attributes:
        name: its Hugging Face name. shape: its shape there.
        ours: the dropless state-dict key it belongs to.
        kind: ``copy`` | ``gate`` | ``up`` | ``down`` | ``shared`` (module docstring).
        expert: the global expert index (``gate``/``up``/``down``), else None.
        rope: ``"q"`` / ``"kv"``: rows holding rope features (permuted when the checkpoint
            is not interleaved), else None.
        layer: decoder layer index (MTP blocks: ``num_hidden_layers + k``), None outside layers.
    """

    name: str
    shape: tuple[int, ...]
    ours: str
    kind: str = "copy"
    expert: int | None = None
    rope: str | None = None
    layer: int | None = None


def _attention(args: ModelArgs, hf: str, ours: str, layer: int) -> list[HFTensor]:
    H, N = args.hidden_size, args.num_attention_heads
    Dq, Dv, C, Q = args.qk_head_dim, args.v_head_dim, args.kv_lora_rank, int(args.q_lora_rank or 0)
    Dr, Dn = args.qk_rope_head_dim, args.qk_nope_head_dim
    out = []
    if Q == 0:
        out.append(HFTensor(f"{hf}.q_proj.weight", (N * Dq, H), f"{ours}.wq.weight", rope="q", layer=layer))
    else:
        out += [HFTensor(f"{hf}.q_a_proj.weight", (Q, H), f"{ours}.wq_a.weight", layer=layer),
                HFTensor(f"{hf}.q_a_layernorm.weight", (Q,), f"{ours}.q_norm.weight", layer=layer),
                HFTensor(f"{hf}.q_b_proj.weight", (N * Dq, Q), f"{ours}.wq_b.weight", rope="q", layer=layer)]
    out += [HFTensor(f"{hf}.kv_a_proj_with_mqa.weight", (C + Dr, H), f"{ours}.wkv_a.weight", rope="kv",
                     layer=layer),
            HFTensor(f"{hf}.kv_a_layernorm.weight", (C,), f"{ours}.kv_norm.weight", layer=layer),
            HFTensor(f"{hf}.kv_b_proj.weight", (N * (Dn + Dv), C), f"{ours}.wkv_b.weight", layer=layer),
            HFTensor(f"{hf}.o_proj.weight", (H, N * Dv), f"{ours}.wo.weight", layer=layer)]
    return out


def _mlp(hf: str, ours: str, H: int, inner: int, layer: int) -> list[HFTensor]:
    return [HFTensor(f"{hf}.gate_proj.weight", (inner, H), f"{ours}.w1.weight", layer=layer),
            HFTensor(f"{hf}.up_proj.weight", (inner, H), f"{ours}.w3.weight", layer=layer),
            HFTensor(f"{hf}.down_proj.weight", (H, inner), f"{ours}.w2.weight", layer=layer)]


def _block(args: ModelArgs, i: int, ours: str, moe: bool) -> list[HFTensor]:
    H, I, E = args.hidden_size, args.moe_intermediate_size, args.n_routed_experts
    hf = f"model.layers.{i}"
    out = [HFTensor(f"{hf}.input_layernorm.weight", (H,), f"{ours}.attention_norm.weight", layer=i),
           HFTensor(f"{hf}.post_attention_layernorm.weight", (H,), f"{ours}.ffn_norm.weight", layer=i)]
    out += _attention(args, f"{hf}.self_attn", f"{ours}.attention", i)
    if not moe:
        return out + _mlp(f"{hf}.mlp", f"{ours}.feed_forward", H, args.intermediate_size, i)
    m = f"{ours}.moe"
    out += [HFTensor(f"{hf}.mlp.gate.weight", (E, H), f"{m}.router.weight", layer=i),
            HFTensor(f"{hf}.mlp.gate.e_score_correction_bias", (E,), f"{m}.router.e_score_correction_bias",
                     layer=i)]
    if args.n_shared_experts > 0:
        out += _mlp(f"{hf}.mlp.shared_experts", f"{m}.shared_experts", H, args.n_shared_experts * I, i)
    for j in range(E):
        ex = f"{hf}.mlp.experts.{j}"
        out += [HFTensor(f"{ex}.gate_proj.weight", (I, H), f"{m}.experts.w13", "gate", j, layer=i),
                HFTensor(f"{ex}.up_proj.weight", (I, H), f"{m}.experts.w13", "up", j, layer=i),
                HFTensor(f"{ex}.down_proj.weight", (H, I), f"{m}.experts.w2", "down", j, layer=i)]
    return out


def hf_tensors(args: ModelArgs) -> list[HFTensor]:
    """Every tensor of the Hugging Face DeepSeek-V3 format for ``args``, in file order:
    embedding, the layers (the MTP layers ``num_hidden_layers + k`` last), final norm, head."""
    H, V = args.hidden_size, args.vocab_size
    moe_ids = set(args.moe_layer_ids())
    out = [HFTensor("model.embed_tokens.weight", (V, H), "tok_embeddings.weight")]
    for i in range(args.num_hidden_layers):
        out += _block(args, i, f"layers.{i}", i in moe_ids)
    for k, i in enumerate(mtp_layer_ids(args)):
        hf, ours = f"model.layers.{i}", f"mtp.layers.{k}"
        out += [HFTensor(f"{hf}.embed_tokens.weight", (V, H), "tok_embeddings.weight", "shared", layer=i),
                HFTensor(f"{hf}.enorm.weight", (H,), f"{ours}.enorm.weight", layer=i),
                HFTensor(f"{hf}.hnorm.weight", (H,), f"{ours}.hnorm.weight", layer=i),
                HFTensor(f"{hf}.eh_proj.weight", (H, 2 * H), f"{ours}.eh_proj.weight", layer=i)]
        out += _block(args, i, f"{ours}.block", mtp_block_is_moe(args, i))
        out += [HFTensor(f"{hf}.shared_head.norm.weight", (H,), f"{ours}.head_norm.weight", layer=i),
                HFTensor(f"{hf}.shared_head.head.weight", (V, H), "output.weight", "shared", layer=i)]
    out += [HFTensor("model.norm.weight", (H,), "norm.weight"),
            HFTensor("lm_head.weight", (V, H), "output.weight")]
    return out


def local_hf_tensors(tensors: list[HFTensor], expert_ranges: dict[str, range]) -> list[HFTensor]:
    """The tensors one rank reads: every non-expert tensor, and of the experts only those in
    ``expert_ranges[ours]`` (global ids of the rank's experts for each ``w13``/``w2``; a key
    that is absent means all experts). ``shared`` copies are left out."""
    out = []
    for t in tensors:
        if t.kind == "shared":
            continue
        if t.expert is not None and t.ours in expert_ranges and t.expert not in expert_ranges[t.ours]:
            continue
        out.append(t)
    return out


def rope_row_permutation(t: HFTensor, args: ModelArgs) -> torch.Tensor | None:
    """Row order that turns a ``rope_interleave = false`` checkpoint tensor into dropless's
    layout (``ours = hf[perm]``), or None for a tensor without rope rows.

    Within each block of ``Dr`` rope rows, dropless's row ``2j`` is the checkpoint's row ``j``
    and row ``2j+1`` is its row ``j + Dr/2`` (``rotate_half`` pairs ``j`` with ``j + Dr/2``).
    """
    if t.rope is None:
        return None
    Dr, half = args.qk_rope_head_dim, args.qk_rope_head_dim // 2
    inner = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)  # [0, h, 1, h+1, ...]
    perm = torch.arange(t.shape[0])
    if t.rope == "kv":
        C = args.kv_lora_rank
        perm[C:C + Dr] = C + inner
        return perm
    Dq, Dn = args.qk_head_dim, args.qk_nope_head_dim
    for h in range(args.num_attention_heads):
        lo = h * Dq + Dn
        perm[lo:lo + Dr] = lo + inner
    return perm
