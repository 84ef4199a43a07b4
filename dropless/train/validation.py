"""The validation loss: the mean cross-entropy over every rank's fixed validation micro-batches."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["validation_loss"]


@torch.no_grad()
def validation_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], routers: list[Any],
                    env: Any, loss: Callable[[torch.Tensor, torch.Tensor], Any]) -> float:
    """Mean validation cross-entropy (nats per token) over ``batches`` (this rank's ``(x, y)`` windows,
    ``[B, S]`` int64 each) on every rank (an all-reduce of the fp64 sum and count where ``env`` is
    distributed). ``loss(x, y)``: the model's loss output (its ``.ce`` is the mean over ``y``'s tokens).

    The model is in eval mode and the ``routers``' non-finite-logit check is off meanwhile (both
    restored after): NaN/Inf weights give a NaN loss, the same on every rank after the all-reduce,
    instead of an error raised on the ranks whose batches met it; the caller judges the value.
    """
    model.eval()
    dev = env.device
    checks = [r.check_finite for r in routers]
    for r in routers:
        r.check_finite = False
    try:
        total = torch.zeros(2, dtype=torch.float64, device=dev)
        for x, y in batches:
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            total[0] += loss(x, y).ce.double() * y.numel()  # the mean over y's tokens
            total[1] += y.numel()
        if env.distributed:
            dist.all_reduce(total)
    finally:
        for r, c in zip(routers, checks):
            r.check_finite = c
        model.train()
    return float(total[0] / total[1])
