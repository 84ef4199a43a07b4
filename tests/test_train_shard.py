"""``train.shard_dense``: the non-expert parameters FSDP2-sharded over all ranks.

Two gloo ranks under torchrun with the a2a dispatcher (EP 2): 8 steps with sharding give the
losses and gradient norms of 8 steps without (relative 1e-5; FSDP2's reduce-scatter and the
trainer's all-reduce average the same gradients in another order), and resuming the sharded
run from its step-4 checkpoint repeats its steps 5-8 bitwise. In-process (2 spawned gloo
ranks): every non-expert parameter becomes a ``Shard(0)`` DTensor over the world holding half
the rows, the experts stay plain tensors, and one forward/backward gives the unsharded model's
loss and world-averaged gradients.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests import dist_harness as H
from tests.test_train import QUICK, _env, records

pytestmark = pytest.mark.slow


def _train(rd, steps, *extra):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "dropless.train", *QUICK, "num_threads=1", "dispatcher=a2a",
                        f"train.steps={steps}", "train.val_every=0", "logging.mode=disabled", f"run_dir={rd}",
                        *extra],
                       capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = sorted((x for x in records(rd) if "loss" in x), key=lambda x: x["step"])
    return {x["step"]: (x["loss"], x["grad_norm"]) for x in recs}


def test_sharded_dense_params_train_and_resume_like_replicated(tmp_path):
    ref = _train(tmp_path / "ref", 8)
    a, b = tmp_path / "a", tmp_path / "b"
    got = _train(a, 8, "train.shard_dense=true", "train.ckpt_every=4", "train.ckpt_keep=0")
    for step, (loss, gnorm) in ref.items():
        assert abs(got[step][0] - loss) <= 1e-5 * abs(loss), (step, got[step], (loss, gnorm))
        assert abs(got[step][1] - gnorm) <= 1e-5 * abs(gnorm), (step, got[step], (loss, gnorm))
    (b / "checkpoints").mkdir(parents=True)  # resume the sharded run from its step-4 checkpoint
    shutil.copytree(a / "checkpoints" / "step_00000004", b / "checkpoints" / "step_00000004")
    again = _train(b, 8, "train.shard_dense=true", "resume=true")
    assert sorted(again) == [5, 6, 7, 8]
    for step in again:
        assert again[step] == got[step], (step, again[step], got[step])  # bitwise


def test_shard_dense_places_every_non_expert_parameter():
    res = H.run_world("shard_dense_worker", 2, deadline_s=120)
    for r in range(2):
        out = res[r]
        assert out["dense_all_sharded"] and out["experts_plain"], out
        assert out["local_fraction"] == pytest.approx(0.5, abs=0.02)
        assert out["loss_rel"] < 1e-6 and out["grad_rel"] < 1e-5, out
