"""Token dispatchers: how the rank's tokens reach their experts (``dispatcher=…``).

The dispatchers of docs/design.md#dispatchers: ``local``, ``a2a``, ``agrs``, ``fsdp``, ``deepep``. All land
expert-sorted, aligned rows with an :class:`~dropless.layout.ExpertLayout` and give the same
outputs and gradients as ``local`` on the same global batch.

Typical use under torchrun::

    from dropless.dispatch import build_dispatcher
    from dropless.dispatch.mesh import build_mesh, start_process_group
    from dropless.dispatch.registry import dispatcher_class
    from dropless.train.shard import apply_fsdp

    start_process_group(timeout_s=300)                   # gloo on CPU, nccl on GPU
    mesh = build_mesh(world, ep_size, "cpu", n_routed_experts=args.n_routed_experts)
    kind = dispatcher_class(name)                        # e.g. "a2a" -> A2ADispatcher, once
    model = Transformer(args, dispatcher_factory=lambda layer: build_dispatcher(kind, args, mesh))
    if kind.shards_experts:                              # fsdp
        apply_fsdp(model, mesh)
"""

from dropless.dispatch.base import CommStats, Dispatched, Dispatcher, Pending
from dropless.dispatch.local import LocalDispatcher
from dropless.dispatch.registry import DISPATCHER_CLASSES, DISPATCHERS, build_dispatcher

__all__ = ["CommStats", "DISPATCHERS", "DISPATCHER_CLASSES", "Dispatched", "Dispatcher", "LocalDispatcher",
           "Pending", "build_dispatcher"]
