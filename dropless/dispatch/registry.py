"""The dispatchers by name (``dispatcher=…``).

:data:`DISPATCHER_CLASSES` is the one name -> class table and :func:`dispatcher_class` the one
lookup in it: a run resolves its ``dispatcher.name`` once
(:attr:`dropless.train.schema.DispatcherConfig.kind`) and passes the class on, whose class
attributes and class methods say what the dispatcher needs (EP size, collectives, FSDP2).
:func:`build_dispatcher` builds one from a class or a name.
"""

from __future__ import annotations

from typing import Any

from dropless.config import ConfigError
from dropless.dispatch.a2a import A2ADispatcher
from dropless.dispatch.agrs import AGRSDispatcher
from dropless.dispatch.base import Dispatcher
from dropless.dispatch.collectives import group_size
from dropless.dispatch.deepep import DeepEPDispatcher
from dropless.dispatch.fsdp import FSDPDispatcher
from dropless.dispatch.local import LocalDispatcher
from dropless.dispatch.mesh import ep_group as _ep_group

__all__ = ["DISPATCHERS", "DISPATCHER_CLASSES", "build_dispatcher", "dispatcher_class"]

DISPATCHER_CLASSES: dict[str, type[Dispatcher]] = {
    "local": LocalDispatcher, "a2a": A2ADispatcher, "agrs": AGRSDispatcher, "fsdp": FSDPDispatcher,
    "deepep": DeepEPDispatcher,
}
#: the names, in the order of docs/design.md#dispatchers
DISPATCHERS = tuple(DISPATCHER_CLASSES)


def dispatcher_class(name: str) -> type[Dispatcher]:
    """The class of ``dispatcher=name`` (case-insensitive).

    Raises:
        ConfigError: an unknown name; the message lists the known ones.
    """
    cls = DISPATCHER_CLASSES.get(str(name).lower())
    if cls is None:
        raise ConfigError(f"dispatcher.name={name!r}: unknown; pick one of {', '.join(DISPATCHERS)}")
    return cls


def build_dispatcher(kind: str | type[Dispatcher], args: Any, ep_group: Any = None, **opts: Any) -> Dispatcher:
    """Build a dispatcher of class ``kind`` (or named ``kind``: one of :data:`DISPATCHERS`).

    Args:
        kind: a :class:`~dropless.dispatch.base.Dispatcher` subclass, or its ``dispatcher=`` name.
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
            by the EP size; an EP group > 1 for ``local``/``fsdp``; an option the dispatcher
            does not take.
    """
    cls = dispatcher_class(kind) if isinstance(kind, str) else kind
    group = _ep_group(ep_group)
    cls.check_ep(group_size(group))
    unknown = sorted(set(opts) - set(cls.options))
    if unknown:
        takes = ", ".join(cls.options) or "none"
        raise ConfigError(f"dispatcher={cls.name}: unknown options {unknown}; {cls.name} takes {takes} "
                          "(only deepep has options: version, num_max_tokens_per_rank)")
    num_experts = int(args.n_routed_experts)
    if not cls.expert_parallel:
        return cls(num_experts)
    return cls(num_experts, group, **opts)
