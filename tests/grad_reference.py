"""Unbucketed references of the trainer's gradient arithmetic (:mod:`dropless.train.grads`), for tests:
a blocking all-reduce of ``p.grad`` over the same groups as :class:`~dropless.train.grads.GradBuckets`,
and the global gradient norm with the clip."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dropless.train.grads import _global_norm, clip_
from dropless.train.optim import is_dtensor


def sync_gradients(params: list[torch.nn.Parameter], expert_ids: set[int], env: Any) -> None:
    """Reference: average ``p.grad`` over the world, blocking (same groups as :class:`GradBuckets`)."""
    if not env.distributed:
        return
    world_g, dp_g = [], []
    for p in params:
        if p.grad is None:  # same collective sizes on every rank
            p.grad = torch.zeros_like(p)
        if is_dtensor(p.grad):
            continue
        (dp_g if (id(p) in expert_ids and env.ep_size > 1) else world_g).append(p.grad)
    for grads, group in ((world_g, None), (dp_g, env.dp_group)):
        if not grads or (group is env.dp_group and env.dp_size <= 1):
            continue
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
    torch._foreach_div_(world_g + dp_g, float(env.world_size))


def grad_norm_and_clip(params: list[torch.nn.Parameter], expert_ids: set[int], env: Any,
                       max_norm: float | None) -> float:
    """Reference: global L2 norm of ``p.grad`` (host float; a sync), clipped to ``max_norm``."""
    rep, ep_sh, dts = [], [], []
    for p in params:
        if p.grad is None:
            continue
        if is_dtensor(p.grad):
            dts.append(p.grad)
        elif id(p) in expert_ids and env.ep_size > 1:
            ep_sh.append(p.grad)
        else:
            rep.append(p.grad)
    norm = _global_norm(rep, ep_sh, dts, env)
    clip_([p.grad for p in params if p.grad is not None], norm, max_norm)
    return float(norm)
