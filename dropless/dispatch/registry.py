"""The dispatchers by name (``dispatcher=…``), and the rules a name puts on the EP size.

:data:`DISPATCHER_CLASSES` is the one name -> class table; :func:`build_dispatcher` builds from
it, :func:`check_dispatcher_ep` is THE check that a dispatcher keeping every expert on every
rank (``local``, ``fsdp``: :attr:`~dropless.dispatch.base.Dispatcher.expert_parallel` False)
runs with EP = 1, and :func:`default_ep_size` says what ``dispatcher.ep_size: null`` means.
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

__all__ = ["DISPATCHERS", "DISPATCHER_CLASSES", "build_dispatcher", "check_dispatcher_ep", "default_ep_size",
           "dispatcher_class"]

DISPATCHER_CLASSES: dict[str, type[Dispatcher]] = {
    "local": LocalDispatcher, "a2a": A2ADispatcher, "agrs": AGRSDispatcher, "fsdp": FSDPDispatcher,
    "deepep": DeepEPDispatcher,
}
#: the names, in the order of docs/design.md#dispatchers
DISPATCHERS = tuple(DISPATCHER_CLASSES)

_OPTIONS = {"deepep": ("version", "num_max_tokens_per_rank")}  # constructor keywords beyond (E, group)


def dispatcher_class(name: str) -> type[Dispatcher]:
    """The class of ``dispatcher=name`` (case-insensitive).

    Raises:
        ConfigError: an unknown name; the message lists the known ones.
    """
    cls = DISPATCHER_CLASSES.get(str(name).lower())
    if cls is None:
        raise ConfigError(f"dispatcher.name={name!r}: unknown; pick one of {', '.join(DISPATCHERS)}")
    return cls


def check_dispatcher_ep(name: str, ep_size: int) -> None:
    """Raise :class:`ConfigError` if ``dispatcher=name`` keeps every expert on every rank and ``ep_size != 1``."""
    cls = dispatcher_class(name)
    if not cls.expert_parallel and ep_size != 1:
        raise ConfigError(f"dispatcher={cls.name} with EP = {ep_size}: {cls.name} keeps every expert on every rank "
                          "(EP = 1); set dispatcher.ep_size=1, or use dispatcher=a2a or agrs for expert parallelism")


def default_ep_size(name: str, world_size: int) -> int:
    """What ``dispatcher.ep_size: null`` means: the world size for an expert-parallel dispatcher, else 1."""
    return world_size if dispatcher_class(name).expert_parallel else 1


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
            by the EP size; an EP group > 1 for ``local``/``fsdp``; an option the dispatcher
            does not take.
    """
    cls = dispatcher_class(name)
    group = _ep_group(ep_group)
    check_dispatcher_ep(cls.name, group_size(group))
    unknown = sorted(set(opts) - set(_OPTIONS.get(cls.name, ())))
    if unknown:
        takes = ", ".join(_OPTIONS.get(cls.name, ())) or "none"
        raise ConfigError(f"dispatcher={cls.name}: unknown options {unknown}; {cls.name} takes {takes} "
                          "(only deepep has options: version, num_max_tokens_per_rank)")
    num_experts = int(args.n_routed_experts)
    if not cls.expert_parallel:
        return cls(num_experts)
    return cls(num_experts, group, **opts)
