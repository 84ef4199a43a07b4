"""Parameter counts read off a built model (works on the meta device).

``activated_per_token`` follows the DeepSeek-V3 report's "37B activated for
each token": every parameter outside the routed experts (embedding, attention,
norms, dense FFNs, routers, shared experts, output head) plus, in each MoE
layer, ``k = num_experts_per_tok`` routed experts' worth of parameters.
"""

from __future__ import annotations

from torch import nn


def _moe_modules(model: nn.Module) -> list[nn.Module]:
    if hasattr(model, "moe_layers"):
        return list(model.moe_layers())
    try:
        from dropless.moe import MoE
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, MoE)]


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
        activated_per_token: ``total - routed + sum over MoE layers of
            k * (routed numel of the layer / local experts of the layer)``.

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
    moes = _moe_modules(model)
    if not moes:
        return total, total
    if num_experts_per_tok is None:
        args = getattr(model, "args", None)
        if args is None:
            raise ValueError("count_parameters: pass num_experts_per_tok (the model has no .args)")
        num_experts_per_tok = args.num_experts_per_tok
    k = int(num_experts_per_tok)
    activated = total
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
