"""The run's position as one Stateful part (dropless.train.progress.Progress): the step counters, the
data loader's position and the LR schedule, restored through the schedule's own state_dict and step."""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful

from dropless.train.config import compose
from dropless.train.data import ShardedLoader
from dropless.train.optim import build_scheduler, lr_at
from dropless.train.progress import Progress


class _Loop:
    def __init__(self):
        self.step, self.skipped_steps = 0, 0


def _part(cfg, total):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=float(cfg.optim.lr))
    loader = ShardedLoader(np.arange(4096, dtype=np.int64) % 97, 16, 2, 0, 1, seed=5)
    return Progress(_Loop(), loader, build_scheduler(opt, cfg.optim, total)), opt


def test_progress_round_trip_sets_the_schedule_loader_and_counters_as_stepping_there_does():
    cfg = compose(["optim.warmup_steps=4"])
    total = 20
    ran, opt = _part(cfg, total)
    assert isinstance(ran, Stateful)
    for _ in range(7):                       # 7 steps: optimizer, schedule and data move on
        opt.step()
        ran.scheduler.step()
        ran.loader.next_window()
    ran.loop.step, ran.loop.skipped_steps = 7, 1
    saved = ran.state_dict()
    assert saved["step"] == 7 and saved["lr_step"] == 7 and saved["skipped_steps"] == 1

    fresh, fresh_opt = _part(cfg, total)
    fresh.load_state_dict(dict(saved))
    assert fresh.loop.step == 7 and fresh.loop.skipped_steps == 1
    assert fresh.state_dict() == saved
    want = lr_at(7, cfg.optim, total)        # the lr of the step after the 7th
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == fresh.scheduler.get_last_lr()[0]
    assert abs(fresh_opt.param_groups[0]["lr"] - want) <= 1e-12 * want
    assert torch.equal(fresh.loader.next_window(), ran.loader.next_window())  # same data position
    for _ in range(3):                       # and the schedule continues as the one that ran
        opt.step()
        fresh_opt.step()
        ran.scheduler.step()
        fresh.scheduler.step()
        assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_progress_sets_the_schedule_of_an_optimizer_with_other_param_groups():
    """A run resumed under another dispatcher splits its parameters into other param groups (FSDP2's
    DTensors get their own): the saved position sets every group of this run's optimizer to the step's
    rate, as a schedule stepped there on this optimizer does."""
    cfg = compose(["optim.warmup_steps=4"])
    total = 20
    ran, opt = _part(cfg, total)
    for _ in range(7):
        opt.step()
        ran.scheduler.step()
    ran.loop.step = 7
    ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    groups = [{"params": [p], "weight_decay": wd} for p, wd in zip(ps, (0.1, 0.0, 0.0))]
    opt3, ref3 = (torch.optim.AdamW(groups, lr=float(cfg.optim.lr)) for _ in range(2))
    loader = ShardedLoader(np.arange(4096, dtype=np.int64) % 97, 16, 2, 0, 1, seed=5)
    fresh = Progress(_Loop(), loader, build_scheduler(opt3, cfg.optim, total))
    fresh.load_state_dict(ran.state_dict())
    ref = build_scheduler(ref3, cfg.optim, total)
    for _ in range(7):
        ref3.step()
        ref.step()
    assert [g["lr"] for g in opt3.param_groups] == [g["lr"] for g in ref3.param_groups] == ref.get_last_lr()
    assert fresh.scheduler.get_last_lr() == ref.get_last_lr() and fresh.scheduler.last_epoch == 7
