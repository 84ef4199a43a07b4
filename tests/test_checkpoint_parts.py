"""The checkpoint's parts (each a DCP ``Stateful``) and the checkpointer deciding when to save.

* A checkpoint in the layout every checkpoint has had (``model`` and ``optim`` from ``get_state_dict``,
  ``trainer``'s five counters, ``rng`` per rank), written here with DCP directly, holds the same keys
  as one the trainer saves, and a run resumed from it repeats the uninterrupted run bitwise, its
  router biases (model buffers, so in the ``model`` part), learning rate and RNG those saved.
* :meth:`Checkpointer.step_end` saves at every ``every``-th step, the last one and a stop request,
  nothing else; the periodic ones in the background with ``asynchronous``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from dropless.train import checkpoint as ckpt
from dropless.train.config import compose
from dropless.train.dist import DistEnv
from dropless.train.trainer import Trainer
from tests.test_train import QUICK, records

COMMON = ["train.steps=4", "train.val_every=0", "train.ckpt_every=0", "train.ckpt_keep=0", "logging.mode=disabled",
          "train.ckpt_async=false"]


def _write_original_layout(tr: Trainer, path: Path) -> None:
    """Step ``tr.step``'s checkpoint as one plain dict, the layout of every checkpoint so far, with its marker."""
    msd, osd = get_state_dict(tr.masters.state_module, tr.optimizer)
    data = tr.loader.state_dict()
    state = {"model": msd, "optim": osd,
             "trainer": {"step": tr.step, "data_epoch": data["epoch"], "data_offset": data["offset"],
                         "lr_step": tr.scheduler.last_epoch, "skipped_steps": tr.skipped_steps},
             "rng": {f"rank{tr.env.rank}": {"cpu": torch.get_rng_state()}}}
    path.mkdir(parents=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    (path / ckpt.MARKER).write_text(f"step {tr.step}\nworld_size 1\n")


def _keys(path: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _routers(tr: Trainer) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": getattr(r, name).detach().clone() for i, r in enumerate(tr.balancer.routers)
            for name in ("e_score_correction_bias", "tokens_per_expert")}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_in_the_original_layout_resumes_the_run_bitwise(tmp_path):
    a, old = tmp_path / "a", tmp_path / "old"
    tr = Trainer(compose(QUICK + [f"run_dir={a}"] + COMMON))
    try:
        tr.train_step()
        tr.train_step()
        routers, lrs, rng = _routers(tr), [g["lr"] for g in tr.optimizer.param_groups], torch.get_rng_state()
        _write_original_layout(tr, ckpt.checkpoint_dir(old, 2))
        new = tr.save_checkpoint()
        tr.train()
    finally:
        tr.close()
    assert _keys(new) == _keys(ckpt.checkpoint_dir(old, 2))
    assert {k.split(".")[0] for k in _keys(new)} == {"model", "optim", "trainer", "rng"}
    assert any(v.abs().sum() > 0 for k, v in routers.items() if k.endswith("bias"))  # the biases moved

    tr = Trainer(compose(QUICK + [f"run_dir={old}", "resume=true"] + COMMON))
    try:
        assert tr.resumed_from == 2 and torch.equal(torch.get_rng_state(), rng)
        got = _routers(tr)
        assert got.keys() == routers.keys() and all(torch.equal(got[k], routers[k]) for k in routers)
        assert [g["lr"] for g in tr.optimizer.param_groups] == lrs == tr.scheduler.get_last_lr()
        tr.train()
    finally:
        tr.close()
    want = {r["step"]: r for r in records(a)}
    got = {r["step"]: r for r in records(old)}
    assert sorted(got) == [3, 4]
    for s in (3, 4):
        assert [got[s][k] for k in ("loss", "grad_norm", "lr", "aux_loss")] == \
               [want[s][k] for k in ("loss", "grad_norm", "lr", "aux_loss")], s


class _Count(Stateful):
    def __init__(self):
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.n = int(state_dict["n"])


def _steps(tmp_path: Path, asynchronous: bool, stop_at: int | None, last: int = 7) -> tuple[list, _Count]:
    env = DistEnv(0, 1, 0, 1, torch.device("cpu"), ep_size=1, dp_size=1)
    part = _Count()
    saver = ckpt.Checkpointer(tmp_path, env, {"count": part}, every=3, asynchronous=asynchronous)
    notes = []
    for step in range(1, last + 1):
        part.n = step
        note = saver.step_end(step, last=step == last, stop=step == stop_at)
        if note is not None:
            notes.append((step, note.path.name, note.periodic, note.in_background))
        if step == stop_at:
            break
    saver.finish()
    return notes, part


def test_step_end_saves_the_periodic_steps_the_last_one_and_a_stop(tmp_path):
    notes, part = _steps(tmp_path / "sync", asynchronous=False, stop_at=None)
    assert notes == [(3, "step_00000003", True, False), (6, "step_00000006", True, False),
                     (7, "step_00000007", False, False)]
    notes, _ = _steps(tmp_path / "async", asynchronous=True, stop_at=None)
    assert notes == [(3, "step_00000003", True, True), (6, "step_00000006", True, True),
                     (7, "step_00000007", False, False)]
    notes, _ = _steps(tmp_path / "stop", asynchronous=True, stop_at=5)
    assert notes == [(3, "step_00000003", True, True), (5, "step_00000005", False, False)]
    for name, steps in (("sync", [3, 6, 7]), ("async", [3, 6, 7]), ("stop", [3, 5])):
        assert [s for s, _ in ckpt.list_checkpoints(tmp_path / name)] == steps
    env = DistEnv(0, 1, 0, 1, torch.device("cpu"), ep_size=1, dp_size=1)
    ckpt.Checkpointer(tmp_path / "async", env, {"count": part}).load(ckpt.checkpoint_dir(tmp_path / "async", 6))
    assert part.n == 6  # the part restored itself, with the step the background save was asked at
