"""The model's parameter and FLOP totals: analytic from :class:`ModelArgs`, or read off a built model.

Both follow DeepSeek's convention for "activated" parameters ("671B total
parameters with 37B activated for each token", DeepSeek-V3 report; "15.7B
total, 2.4B activated", DeepSeek-V2-Lite): every parameter outside the routed
experts (attention, norms, dense FFNs, routers, shared experts, output head)
plus, in each MoE layer, ``k = num_experts_per_tok`` routed experts' worth of
parameters; the input embedding table is left out (a token only looks up one
row; counting the table would give V2-Lite 2.66B, not 2.4B). A tied embedding
is counted once, as the head. DeepSeek-V3: 671,026,404,352 total and
36,625,603,584 activated, by :func:`param_counts` and by
:func:`count_parameters` on the meta-device model alike.

* :func:`param_counts` (:class:`ParamCounts`): analytic, from the config alone.
* :func:`moe_flops_per_token`, :func:`model_flops_per_token`: training FLOPs per
  token (the trainer's MFU and ``dropless-plan`` divide by them).
* :func:`count_parameters`: counted on a built module (works on the meta device).

Units: parameters are counts; FLOPs are floating-point operations (a
multiply-add is 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dropless.config import ModelArgs
from dropless.model.mtp import mtp_block_is_moe, mtp_layer_ids
from dropless.moe import MoE

__all__ = ["ParamCounts", "count_parameters", "model_flops_per_token", "moe_flops_per_token", "param_counts"]


# --------------------------------------------------------------------------- analytic, from ModelArgs
@dataclass(frozen=True)
class ParamCounts:
    """Analytic parameter counts of a DeepSeek-V3-shaped model (no MTP module).

    Attributes:
        total: every parameter (embedding, attention + norms, dense MLPs,
            router weights, routed and shared experts, final norm, untied head).
        activated: parameters one token's forward pass uses: ``total`` minus the
            routed experts it does not pick (``E − k`` per MoE layer) and minus
            the input embedding table (a lookup, not a matmul; cf. Kaplan et al.
            2020 who count non-embedding parameters). The output head is counted.
        embedding: the input embedding ``V·H``.
        attention: all layers' MLA projections and their norms (q_norm, kv_norm).
        dense_mlp: the first-k-dense SwiGLU layers.
        routed_experts: all routed experts of all MoE layers.
        shared_experts: all shared experts.
        router: all router weights ``[E, H]`` (the selection bias is a buffer, not counted).
        norms: the per-layer input / post-attention RMSNorms and the final norm.
        head: the output projection ``[V, H]``.
    """

    total: int
    activated: int
    embedding: int = 0
    attention: int = 0
    dense_mlp: int = 0
    routed_experts: int = 0
    shared_experts: int = 0
    router: int = 0
    norms: int = 0
    head: int = 0


def _attention_params(args: ModelArgs) -> tuple[int, int]:
    """(matmul params, norm params) of one MLA block (DeepSeek-V2/V3 MLA, no biases)."""
    H, N = args.hidden_size, args.num_attention_heads
    qk, C, Dr = args.qk_head_dim, args.kv_lora_rank, args.qk_rope_head_dim
    Q = args.q_lora_rank or 0
    if Q > 0:
        q_mm, q_norm = H * Q + Q * N * qk, Q          # wq_a, wq_b; q_norm
    else:
        q_mm, q_norm = H * N * qk, 0                  # wq
    kv_mm = H * (C + Dr) + C * N * (args.qk_nope_head_dim + args.v_head_dim)  # wkv_a, wkv_b
    o_mm = N * args.v_head_dim * H                     # wo
    return q_mm + kv_mm + o_mm, q_norm + C


def param_counts(args: ModelArgs) -> ParamCounts:
    """Parameters of the model ``args`` describes, counted analytically (no MTP module).

    Per layer: MLA (``wq_a [Q,H]``, ``q_norm [Q]``, ``wq_b [N·(Dn+Dr),Q]``, or ``wq``
    without q_lora; ``wkv_a [C+Dr,H]``, ``kv_norm [C]``, ``wkv_b [N·(Dn+Dv),C]``,
    ``wo [H,N·Dv]``), two RMSNorms ``[H]``, then either a dense SwiGLU
    ``3·H·intermediate_size`` or an MoE (router ``[E,H]``, ``E`` routed and
    ``n_shared_experts`` shared SwiGLU experts of ``3·H·I``). Plus the embedding
    ``[V,H]``, the final norm ``[H]`` and an untied output head ``[V,H]`` (tied:
    counted once).

    DeepSeek-V3 (:meth:`ModelArgs.deepseek_v3_671b`): total 671,026,404,352
    ≈ 671B; activated 36,625,603,584 ≈ 37B (paper: "671B total parameters with
    37B activated for each token"; the 14B MTP module is not counted).
    """
    H, V = args.hidden_size, args.vocab_size
    L = args.num_hidden_layers
    n_moe = args.num_moe_layers
    n_dense = L - n_moe
    attn_mm, attn_norm = _attention_params(args)
    expert = 3 * H * args.moe_intermediate_size
    embedding = V * H
    head = 0 if args.tie_word_embeddings else V * H
    attention = L * (attn_mm + attn_norm)
    dense_mlp = n_dense * 3 * H * args.intermediate_size
    routed = n_moe * args.n_routed_experts * expert
    shared = n_moe * args.n_shared_experts * expert
    router = n_moe * args.n_routed_experts * H
    norms = L * 2 * H + H
    total = embedding + attention + dense_mlp + routed + shared + router + norms + head
    activated_routed = n_moe * args.num_experts_per_tok * expert
    activated = total - routed + activated_routed - (embedding if head else 0)
    return ParamCounts(total=total, activated=activated, embedding=embedding, attention=attention,
                       dense_mlp=dense_mlp, routed_experts=routed, shared_experts=shared,
                       router=router, norms=norms, head=head)


def moe_flops_per_token(args: ModelArgs, seq_len: int, routed_rows_per_token: float | None = None,
                        causal: bool = True) -> float:
    """Training FLOPs per token (forward + backward), counting the routed rows actually computed.

    ``6 · (matmul params a token touches) + 6 · L · N · (Dqk + Dv) · S · c``,
    with ``c = 1/2`` for causal attention (1 otherwise). The matmul params are
    the MLA projections, dense MLPs, routers, shared experts, the output head
    and ``routed_rows_per_token`` routed experts per MoE layer (the embedding
    lookup and the norms are not matmuls). The attention term is PaLM's
    (Chowdhery et al. 2022, appendix B: ``6N + 12·L·H·Q·T``) written for MLA's
    unequal query/key and value head dims and halved for causal masking. Each
    multi-token-prediction depth ``k`` (``num_nextn_predict_layers``) adds its
    ``eh_proj`` (``2H·H``), its decoder block and the shared output head on the
    ``S - k`` positions it predicts (so ``(S - k)/S`` of that per token), with
    attention over ``S - k``. With ``causal=False`` it equals the matmul FLOPs
    :class:`torch.utils.flop_counter.FlopCounterMode` counts for a forward and
    backward of the model in fp32 with ``gemm=loop`` (``tests/test_plan.py``).

    Args:
        args: the model.
        seq_len: tokens per sequence ``S``.
        routed_rows_per_token: mean routed rows computed per token; None = ``k``
            (dropless computes exactly ``k`` live rows per token: use this for
            MFU). With a capacity factor pass ``(T·k − dropped)/T``; the
            padding rows are not useful work and are not counted.
        causal: halve the score/value term for a causal mask.
    Returns: FLOPs per token (float).
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len={seq_len!r} must be a positive integer")
    rows = args.num_experts_per_tok if routed_rows_per_token is None else routed_rows_per_token
    if rows < 0:
        raise ValueError(f"routed_rows_per_token={rows!r} must be >= 0")
    H, V, L = args.hidden_size, args.vocab_size, args.num_hidden_layers
    n_moe = args.num_moe_layers
    attn_mm, _ = _attention_params(args)
    expert = 3 * H * args.moe_intermediate_size
    moe_mm = args.n_routed_experts * H + args.n_shared_experts * expert + rows * expert
    matmul = L * attn_mm + (L - n_moe) * 3 * H * args.intermediate_size + n_moe * moe_mm + V * H
    per_ctx = 6 * args.num_attention_heads * (args.qk_head_dim + args.v_head_dim) * (0.5 if causal else 1.0)
    flops = 6.0 * matmul + L * per_ctx * seq_len
    for layer_id in mtp_layer_ids(args):  # MTP depth k runs on the S - k positions that have a target
        n = seq_len - (layer_id - L + 1)
        if n <= 0:
            continue
        block_mm = attn_mm + (moe_mm if mtp_block_is_moe(args, layer_id) else 3 * H * args.intermediate_size)
        flops += n / seq_len * (6.0 * (2 * H * H + block_mm + V * H) + per_ctx * n)  # eh_proj, block, head
    return flops


def model_flops_per_token(args: ModelArgs, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs per token: ``6 × activated matmul params + attention`` (dropless: k rows per token).

    See :func:`moe_flops_per_token` for the formula (PaLM appendix B, causal
    halving). DeepSeek-V3 at S = 4,096: ≈ 2.50e11.
    """
    return moe_flops_per_token(args, seq_len, None, causal)


# --------------------------------------------------------------------------- counted on a built model
def _moe_modules(model: nn.Module) -> list[nn.Module]:
    if hasattr(model, "moe_layers"):
        return list(model.moe_layers())
    return [m for m in model.modules() if isinstance(m, MoE)]


def _untied_embedding_numel(model: nn.Module) -> int:
    """numel of ``nn.Embedding`` weights that no other module shares (a lookup, not a matmul)."""
    users: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, nn.Embedding) and users[id(m.weight)] == 1)


def count_parameters(model: nn.Module, num_experts_per_tok: int | None = None) -> tuple[int, int]:
    """``(total, activated_per_token)`` parameter counts of ``model``.

    Args:
        model: a :class:`dropless.model.Transformer` (or any module holding
            :class:`dropless.moe.MoE` layers); may live on the meta device.
        num_experts_per_tok: k; None reads ``model.args.num_experts_per_tok``.

    Returns:
        total: numel of every distinct parameter this module holds (a DTensor
            counts its global shape; an expert-parallel rank counts only its
            local experts).
        activated_per_token: ``total - routed - input embedding + sum over MoE
            layers of k * (routed numel of the layer / local experts of the layer)``
            (an embedding weight shared with another module stays counted).

    Raises:
        ValueError: k unknown, or a layer's expert parameters do not have the
            local-expert count as their leading dimension.
    """
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    activated = total - _untied_embedding_numel(model)
    moes = _moe_modules(model)
    if not moes:
        return total, activated
    if num_experts_per_tok is None:
        args = getattr(model, "args", None)
        if args is None:
            raise ValueError("count_parameters: pass num_experts_per_tok (the model has no .args)")
        num_experts_per_tok = args.num_experts_per_tok
    k = int(num_experts_per_tok)
    for moe in moes:
        expert_params = list(moe.experts.parameters())
        n_local = int(expert_params[0].shape[0])
        routed = 0
        for p in expert_params:
            if int(p.shape[0]) != n_local:
                raise ValueError(f"count_parameters: expert parameter of shape {tuple(p.shape)} "
                                 f"does not lead with the local-expert count {n_local}")
            routed += p.numel()
        activated += k * (routed // n_local) - routed
    return total, activated
