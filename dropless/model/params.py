"""Parameter counts read off a built model (works on the meta device).

``activated_per_token`` follows DeepSeek's convention ("671B total parameters
with 37B activated for each token", DeepSeek-V3 report; "15.7B total, 2.4B
activated", DeepSeek-V2-Lite): every parameter outside the routed experts
(attention, norms, dense FFNs, routers, shared experts, output head) plus, in
each MoE layer, ``k = num_experts_per_tok`` routed experts' worth of
parameters; the input embedding table is left out (a token only looks up one
row; counting the table would give V2-Lite 2.66B, not 2.4B). A tied embedding
is counted once, as the head. DeepSeek-V3 gives 671,026,404,352 total and
36,625,603,584 activated, the same as :func:`dropless.plan.param_counts`.
"""

from __future__ import annotations

from torch import nn


def _moe_modules(model: nn.Module) -> list[nn.Module]:
    if hasattr(model, "moe_layers"):
        return list(model.moe_layers())
    from dropless.moe import MoE  # lazy: dropless.moe imports dropless.model

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
