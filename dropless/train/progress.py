"""Where a run stands, saved and restored as one part: the checkpoint's ``trainer`` entry.

:class:`Progress` is a :class:`~torch.distributed.checkpoint.stateful.Stateful` over the step
counters (:class:`~dropless.train.step.StepLoop`'s ``step`` and ``skipped_steps``), the data
loader's position and the learning-rate schedule's step. Its keys are those every checkpoint
holds: ``step``, ``data_epoch``, ``data_offset``, ``lr_step``, ``skipped_steps`` (plain ints, the
same on every rank).

The schedule is saved as its step (its ``last_epoch``), not as its whole ``state_dict()``: the rest of
that state (``base_lrs`` and the last learning rates, one per param group) belongs to this run's
optimizer, whose split into param groups depends on the dispatcher (a run saved under ``a2a`` resumes
under ``fsdp`` with more groups), and every group's rate is a function of the step
(:func:`dropless.train.optim.lr_at`).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from dropless.train.data import ShardedLoader
from dropless.train.optim import schedule_step

__all__ = ["Progress"]


class Progress(Stateful):
    """The run's position. ``loop``: the object holding ``step`` and ``skipped_steps``; ``loader``: the
    training :class:`~dropless.train.data.ShardedLoader`; ``scheduler``: the optimizer's LR schedule."""

    def __init__(self, loop: Any, loader: ShardedLoader, scheduler: Any):
        self.loop, self.loader, self.scheduler = loop, loader, scheduler

    def state_dict(self) -> dict[str, int]:
        d = self.loader.state_dict()
        return {"step": self.loop.step, "data_epoch": d["epoch"], "data_offset": d["offset"],
                "lr_step": self.scheduler.last_epoch, "skipped_steps": self.loop.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the counters and the data position; the schedule goes to one step before ``lr_step`` through
        its own ``load_state_dict`` (its ``last_epoch``; the rest of its state is this run's) and takes that
        step with ``step()``, which sets the step's learning rate in the optimizer's param groups (whatever
        a checkpoint load left there)."""
        self.loop.step = int(state_dict["step"])
        self.loop.skipped_steps = int(state_dict["skipped_steps"])
        self.loader.load_state_dict({"epoch": state_dict["data_epoch"], "offset": state_dict["data_offset"]})
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), "last_epoch": int(state_dict["lr_step"]) - 1})
        schedule_step(self.scheduler)  # the optimizer has not stepped in this process
