"""Token dispatchers: how the rank's tokens reach their experts (``dispatcher=…``).

DESIGN.md's dispatcher table: ``local``, ``a2a``, ``agrs``, ``fsdp``, ``deepep``. All land
expert-sorted, aligned rows with an :class:`~dropless.layout.ExpertLayout` and give the same
outputs and gradients as ``local`` on the same global batch.

Typical use under torchrun::

    from dropless.dispatch import build_dispatcher
    from dropless.dispatch.mesh import build_mesh, init_distributed
    from dropless.train.shard import apply_fsdp

    init_distributed(timeout_s=300)                      # gloo on CPU, nccl on GPU
    mesh = build_mesh(world, ep_size, "cpu", n_routed_experts=args.n_routed_experts)
    model = Transformer(args, dispatcher_factory=lambda layer: build_dispatcher(name, args, mesh))
    if name == "fsdp":
        apply_fsdp(model, mesh)
"""

from __future__ import annotations

from typing import Any

from dropless.config import ConfigError
from dropless.dispatch.a2a import A2ADispatcher
from dropless.dispatch.agrs import AGRSDispatcher
from dropless.dispatch.base import CommStats, Dispatched, Dispatcher, Pending
from dropless.dispatch.collectives import group_size
from dropless.dispatch.deepep import DeepEPDispatcher
from dropless.dispatch.fsdp import FSDPDispatcher
from dropless.dispatch.local import LocalDispatcher
from dropless.dispatch.mesh import ep_group as _ep_group

DISPATCHERS = ("local", "a2a", "agrs", "fsdp", "deepep")


def build_dispatcher(name: str, args: Any, ep_group: Any = None, **opts: Any) -> Dispatcher:
    """Build the dispatcher named by the config flag.

    Args:
        name: one of :data:`DISPATCHERS`.
        args: the :class:`~dropless.config.ModelArgs` (reads ``n_routed_experts``).
        ep_group: the expert-parallel process group, or a mesh from
            :func:`dropless.dispatch.mesh.build_mesh` (its ``"ep"`` dimension is used).
            None: EP = 1 (no expert parallelism; ``a2a``/``agrs`` then move nothing). To
            spread experts over the whole world pass ``dist.group.WORLD`` or the mesh.
            For ``local``/``fsdp`` it must be None or a group of one rank.
        **opts: passed to the dispatcher's constructor (``deepep``: ``version``,
            ``num_max_tokens_per_rank``).
    Raises:
        ConfigError: an unknown name (the message lists the known ones); ``deepep`` without
            ``deep_ep`` (the message says how to install it); ``n_routed_experts`` not divisible
            by the EP size; an EP group > 1 for ``local``/``fsdp``.
    """
    key = str(name).lower()
    if key not in DISPATCHERS:
        raise ConfigError(f"dispatcher.name={name!r}: unknown; pick one of {', '.join(DISPATCHERS)}")
    num_experts = int(args.n_routed_experts)
    group = _ep_group(ep_group)
    if key in ("local", "fsdp"):
        if ep_group is not None and group_size(group) != 1:
            raise ConfigError(f"dispatcher={key} puts every expert on every rank (EP = 1), but the given EP group "
                              f"has {group_size(group)} ranks; set dispatcher.ep_size=1")
        if opts:
            raise ConfigError(f"dispatcher={key}: unknown options {sorted(opts)}; {key} takes none "
                              "(only deepep has options: version, num_max_tokens_per_rank)")
        if key == "local":
            return LocalDispatcher(num_experts)
        return FSDPDispatcher(num_experts)
    ep = group_size(group)
    if num_experts % ep:
        raise ConfigError(f"n_routed_experts={num_experts} is not divisible by the EP size {ep} "
                          f"(dispatcher={key}); pick dispatcher.ep_size among the divisors of {num_experts}")
    if key == "deepep":
        return DeepEPDispatcher(num_experts, group, **opts)
    if opts:
        raise ConfigError(f"dispatcher={key}: unknown options {sorted(opts)}; {key} takes none "
                          "(only deepep has options: version, num_max_tokens_per_rank)")
    if key == "a2a":
        return A2ADispatcher(num_experts, group)
    return AGRSDispatcher(num_experts, group)


__all__ = ["CommStats", "DISPATCHERS", "Dispatched", "Dispatcher", "LocalDispatcher", "Pending",
           "build_dispatcher"]
