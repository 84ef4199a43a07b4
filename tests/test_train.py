"""The training job end to end on CPU: metrics, wandb offline, checkpoint/resume, Ctrl-C, torchrun.

Resume equality is asserted bitwise (``==`` on the logged float losses, grad norms and
validation losses): on CPU, with the same thread count, a resumed run repeats the
uninterrupted run's arithmetic exactly.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dropless.train.config import compose
from dropless.train.console import Console
from dropless.train.metrics import REQUIRED_KEYS
from dropless.train.startup import check_train_config
from dropless.train.trainer import Trainer, lr_at

# a small, quick version of the CPU default (the tiny MoE model, the stdlib's bytes)
# device=cpu: these runs check the CPU path (several ranks through gloo) on any machine, a GPU one too
QUICK = ["train.micro_batch_size=8", "train.seq_len=64", "optim.warmup_steps=2", "train.val_batches=2",
         "logging.progress=false", "num_threads=2", "device=cpu"]


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def run(overrides: list[str]) -> tuple[dict, Trainer]:
    tr = Trainer(compose(QUICK + overrides))
    try:
        return tr.train(), tr
    finally:
        tr.close()


def test_short_run_writes_every_metric_and_learns(tmp_path):
    rd = tmp_path / "run"
    summary, tr = run([f"run_dir={rd}", "train.steps=8", "train.val_every=4", "logging.histogram_every=4"])
    recs = records(rd)
    steps = [r for r in recs if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 4, 8]
    moe_ids = tr.args.moe_layer_ids()
    tokens = 8 * 64
    for r in steps:
        for k in REQUIRED_KEYS:
            assert k in r and r[k] is not None, k
        for i in moe_ids:
            for k in ("max_over_mean", "min_over_mean", "empty_experts"):
                assert f"expert_load/layer{i}/{k}" in r
            assert r[f"expert_load/layer{i}/max_over_mean"] >= 1.0 >= r[f"expert_load/layer{i}/min_over_mean"]
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, tr.cfg.optim, 8))
        assert r["rows_dropped"] == 0 and r["dispatch_bytes_sent"] == 0      # dropless, local dispatcher
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["peak_mem_gib"] > 0.05
        assert r["tflops"] == pytest.approx(r["tokens_per_s"] * _fpt(tr) / 1e12, rel=1e-9)   # one process
        assert r["mfu"] == pytest.approx(r["tflops"] * 1e12 / tr.cfg.logging.cpu_peak_flops, rel=1e-9)
    for s in (4, 8):                       # histogram steps: the step's per-expert rows, all micro-batches
        r = next(x for x in recs if x["step"] == s)
        for i in moe_ids:
            c = r[f"expert_load/layer{i}/counts"]
            assert len(c) == tr.args.n_routed_experts and sum(c) == tokens * tr.args.num_experts_per_tok
            mean = sum(c) / len(c)
            assert r[f"expert_load/layer{i}/max_over_mean"] == pytest.approx(max(c) / mean)
            assert r[f"expert_load/layer{i}/empty_experts"] == sum(x == 0 for x in c)
    assert recs[0]["val_loss"] == pytest.approx(5.55, abs=0.15)     # ≈ ln 256 at init
    losses = [r["loss"] for r in steps]
    assert max(losses[-2:]) < losses[0] - 0.5 and recs[-1]["val_loss"] < recs[0]["val_loss"] - 0.5
    runs = list((rd / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert (rd / "config.yaml").is_file() and (rd / "checkpoints" / "step_00000008" / ".metadata").is_file()
    assert summary["steps"] == 8 and not summary["interrupted"]


def _fpt(tr) -> float:
    from dropless.plan import model_flops_per_token
    return model_flops_per_token(tr.args, tr.seq_len)


def test_capacity_factor_drops_rows_and_counts_fewer_flops(tmp_path):
    _, tr = run([f"run_dir={tmp_path}", "train.steps=2", "train.val_every=0", "logging.mode=disabled",
                 "model.capacity_factor=0.5"])
    for r in records(tmp_path):
        assert r["rows_dropped"] > 0
        assert r["tflops"] < r["tokens_per_s"] * _fpt(tr) / 1e12   # dropped rows are not counted
    # at capacity factor 0.5 at least half of the T·k rows of every MoE layer are dropped
    assert records(tmp_path)[-1]["rows_dropped"] >= 0.5 * 512 * 2 * tr.args.num_moe_layers


def test_rows_dropped_is_the_sum_over_layers_and_micro_batches(tmp_path):
    tr = Trainer(compose(QUICK + [f"run_dir={tmp_path}", "train.steps=1", "train.val_every=0",
                                  "logging.mode=disabled", "model.capacity_factor=0.5", "train.grad_accum=2"]))
    try:
        seen = []
        for m in tr.moe_layers:
            m.register_forward_hook(lambda mod, a, out: seen.append(int(mod.last_stats["rows_dropped"])))
        rec = tr.train_step()
        assert len(seen) == 2 * tr.args.num_moe_layers and sum(seen) > 0
        assert rec["rows_dropped"] == sum(seen)           # summed over layers and micro-batches
    finally:
        tr.close()


def test_resume_repeats_the_uninterrupted_run_bitwise(tmp_path):
    """The conditions of a bitwise resume, all explicit here: one process, the same ``num_threads`` (2;
    both trainers are checked to have run with it), the same torch build and CPU, synchronous saves.
    The machine's load is not one of them (the CPU kernels' work split depends on the thread count,
    which ``num_threads`` fixes, not on how busy the cores are); on a mismatch the message gives the
    thread counts and the load average, to tell a changed condition from a changed computation."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["train.steps=6", "train.val_every=3", "train.ckpt_every=3", "train.ckpt_keep=0", "logging.mode=disabled",
              "train.grad_accum=2", "train.ckpt_async=false"]
    _, tr_a = run([f"run_dir={a}"] + common)
    threads_a = torch.get_num_threads()
    assert (a / "checkpoints" / "step_00000003" / ".metadata").is_file()
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "step_00000003", b / "checkpoints" / "step_00000003")
    summary, tr = run([f"run_dir={b}", "resume=true"] + common)
    threads_b = torch.get_num_threads()
    assert threads_a == threads_b == 2 and tr_a.env.world_size == tr.env.world_size == 1
    assert tr.resumed_from == 3 and summary["steps"] == 6
    ra = {r["step"]: r for r in records(a)}
    rb = {r["step"]: r for r in records(b)}
    assert sorted(rb) == [4, 5, 6]
    for s in (4, 5, 6):
        for k in ("loss", "grad_norm", "lr", "aux_loss"):
            assert rb[s][k] == ra[s][k], (s, k, rb[s][k], ra[s][k], f"threads {threads_a}/{threads_b}",
                                          f"load average {os.getloadavg()}")
    assert rb[6]["val_loss"] == ra[6]["val_loss"]
    for i in tr.args.moe_layer_ids():
        assert rb[6][f"expert_load/layer{i}/max_over_mean"] == ra[6][f"expert_load/layer{i}/max_over_mean"]


def test_ckpt_threads_write_one_file_each_and_resume_the_same(tmp_path):
    """train.ckpt_threads=N: each rank's checkpoint is N files written side by side (DCP's
    thread_count); resuming from it gives the steps of resuming from a one-file checkpoint."""
    common = ["train.steps=4", "train.val_every=0", "train.ckpt_every=2", "train.ckpt_keep=0", "logging.mode=disabled"]
    out = {}
    for n in (1, 3):
        rd = tmp_path / f"t{n}"
        run([f"run_dir={rd}", f"train.ckpt_threads={n}"] + common)
        assert len(list((rd / "checkpoints" / "step_00000002").glob("*.distcp"))) == n
        shutil.rmtree(rd / "checkpoints" / "step_00000004")
        (rd / "metrics.jsonl").unlink()
        run([f"run_dir={rd}", "resume=true", f"train.ckpt_threads={n}"] + common)
        out[n] = [(r["loss"], r["grad_norm"]) for r in records(rd)]
    assert len(out[1]) == 2 and out[1] == out[3]


def test_run_dir_with_checkpoints_needs_resume(tmp_path):
    from dropless.config import ConfigError
    run([f"run_dir={tmp_path}", "train.steps=1", "train.val_every=0", "logging.mode=disabled"])
    with pytest.raises(ConfigError, match="resume=true"):
        Trainer(compose(QUICK + [f"run_dir={tmp_path}", "train.steps=2"]))
    with pytest.raises(ConfigError, match=r"^resume=true: .*run_dir"):
        Trainer(compose(QUICK + ["resume=true"]))


def _env() -> dict:
    env = dict(os.environ)
    env.pop("WANDB_MODE", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_that_resumes(tmp_path):
    rd = tmp_path / "run"
    cmd = [sys.executable, "-m", "dropless.train", *QUICK, f"run_dir={rd}", "train.steps=500",
           "train.val_every=0", "train.ckpt_every=0", "logging.mode=disabled"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    metrics = rd / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130, out
    from dropless.train.checkpoint import latest_checkpoint
    step, _ = latest_checkpoint(rd)
    assert 3 <= step < 500 and f"stopped at step {step}" in out
    assert records(rd)[-1]["step"] == step
    out2 = subprocess.run([*cmd[:-4], "resume=true", f"run_dir={rd}", f"train.steps={step + 2}",
                           "train.val_every=0", "logging.mode=disabled"],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert out2.returncode == 0, out2.stdout + out2.stderr
    assert f"resumed from step {step}" in out2.stdout
    assert [r["step"] for r in records(rd)][-3:] == [step, step + 1, step + 2]


@pytest.mark.slow
def test_torchrun_two_processes_a2a_checkpoint_resume(tmp_path):
    """2 ranks (gloo), expert parallel a2a: trains, logs, and resumes from an EP checkpoint bitwise."""
    a, b = tmp_path / "a", tmp_path / "b"
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "dropless.train", *QUICK, "num_threads=1", "dispatcher=a2a", "train.steps=4",
            "train.val_every=2", "train.ckpt_every=2", "train.ckpt_keep=0", "logging.mode=disabled"]
    r = subprocess.run([*base, f"run_dir={a}"], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "world 2 = dp 1 x ep 2" in r.stdout and r.stdout.count("resolved config") == 1
    ra = {x["step"]: x for x in records(a)}
    assert sorted(ra) == [0, 1, 2, 3, 4]
    assert all(ra[s]["dispatch_bytes_sent"] > 0 for s in (1, 2, 3, 4))
    assert ra[4]["loss"] < ra[1]["loss"]
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "step_00000002", b / "checkpoints" / "step_00000002")
    r = subprocess.run([*base, f"run_dir={b}", "resume=true"], capture_output=True, text=True, env=_env(),
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rb = {x["step"]: x for x in records(b)}
    assert sorted(rb) == [3, 4]
    for s in (3, 4):
        assert (rb[s]["loss"], rb[s]["grad_norm"]) == (ra[s]["loss"], ra[s]["grad_norm"])
    assert rb[4]["val_loss"] == ra[4]["val_loss"]


@pytest.mark.slow
def test_torchrun_world_size_not_fitting_the_mesh(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "dropless.train", "dispatcher=a2a", "dispatcher.ep_size=4", f"run_dir={tmp_path}",
                        "device=cpu"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode != 0
    assert "world size 2 does not fit the mesh" in r.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resume_from_another_model_config_fails_clearly(tmp_path):
    """A checkpoint without some of this model's weights (saved with n_shared_experts=0) is
    refused by name before anything loads, not partially loaded."""
    rd = tmp_path / "run"
    run([f"run_dir={rd}", "train.steps=1", "train.val_every=0", "logging.mode=disabled", "model.n_shared_experts=0"])
    from dropless.config import ConfigError

    with pytest.raises(ConfigError, match="shared_experts.*saved by a different model"):
        run([f"run_dir={rd}", "resume=true", "train.steps=2", "train.val_every=0", "logging.mode=disabled"])


def test_resume_after_a_crash_logs_each_step_once(tmp_path):
    """A run killed after its step-3 checkpoint had logged steps 4-6 already; resuming trains them again
    and metrics.jsonl ends with one record per step (the later records of the dead start dropped), and
    equal to the uninterrupted run's."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["train.steps=6", "train.val_every=0", "train.ckpt_every=3", "train.ckpt_keep=0", "logging.mode=disabled"]
    run([f"run_dir={a}"] + common)
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "step_00000006")   # the crash: the last checkpoint never written
    with (b / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "loss": 1.0')              # and a line cut short by the kill
    _, tr = run([f"run_dir={b}", "resume=true"] + common)
    assert tr.resumed_from == 3
    steps = [r["step"] for r in records(b)]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records(b)] == [r["loss"] for r in records(a)]


def test_resume_without_a_checkpoint_starts_at_step_0_and_says_so(tmp_path, capsys):
    """resume=true in a new (missing) run_dir, or one holding only an interrupted save, trains from
    step 0 (launchers always pass resume=true) and prints that it found nothing to resume."""
    rd = tmp_path / "new_run"
    (tmp_path / "other" / "checkpoints" / "step_00000001.partial").mkdir(parents=True)  # a killed save
    for d in (rd, tmp_path / "other"):
        summary, tr = run([f"run_dir={d}", "resume=true", "train.steps=1", "train.val_every=0",
                           "logging.mode=disabled"])
        assert tr.resumed_from is None and summary["steps"] == 1
        assert [r["step"] for r in records(d)] == [1]
        said = [line for line in capsys.readouterr().out.splitlines() if "resume=true" in line]
        assert len(said) == 1 and "no checkpoint" in said[0] and said[0].endswith("step 0"), said


def _val_batches(rd: Path, n: int) -> int:
    tr = Trainer(compose(QUICK + [f"run_dir={rd}", "train.val_every=1", f"train.val_batches={n}",
                                  "logging.mode=disabled"]))  # said at start-up, before any step
    tr.close()
    return len(tr.val_batches)


def test_val_batches_beyond_the_validation_split_are_capped_and_said(tmp_path, capsys):
    n = _val_batches(tmp_path / "a", 100000)
    assert 0 < n < 100000
    said = [line for line in capsys.readouterr().out.splitlines() if "train.val_batches=100000" in line]
    assert len(said) == 1 and f" {n} " in said[0]
    assert _val_batches(tmp_path / "b", n) == n and "validation split holds" not in capsys.readouterr().out


def test_new_start_in_a_run_dir_without_checkpoint_moves_old_metrics_aside(tmp_path, capsys):
    run([f"run_dir={tmp_path}", "train.steps=2", "train.val_every=0", "train.ckpt_every=0", "logging.mode=disabled"])
    for d in (tmp_path / "checkpoints").iterdir():      # a run that died before its first checkpoint
        shutil.rmtree(d)
    old = (tmp_path / "metrics.jsonl").read_text()
    run([f"run_dir={tmp_path}", "train.steps=2", "train.val_every=0", "logging.mode=disabled"])
    assert [r["step"] for r in records(tmp_path)] == [1, 2]
    assert (tmp_path / "metrics.jsonl.old").read_text() == old
    assert "moved to metrics.jsonl.old" in capsys.readouterr().out
    second = (tmp_path / "metrics.jsonl").read_text()
    for d in (tmp_path / "checkpoints").iterdir():
        shutil.rmtree(d)
    run([f"run_dir={tmp_path}", "train.steps=2", "train.val_every=0", "logging.mode=disabled"])
    assert (tmp_path / "metrics.jsonl.old").read_text() == old                 # never overwritten
    assert (tmp_path / "metrics.jsonl.old2").read_text() == second


def test_resume_with_another_model_shape_names_the_tensors(tmp_path):
    rd = tmp_path / "run"
    run([f"run_dir={rd}", "train.steps=1", "train.val_every=0", "logging.mode=disabled"])
    from dropless.config import ConfigError

    saved = (rd / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"tok_embeddings.weight: checkpoint \[256, 128\], model \[256, 64\]"):
        run([f"run_dir={rd}", "resume=true", "train.steps=2", "train.val_every=0", "logging.mode=disabled",
             "model.hidden_size=64"])
    assert (rd / "config.yaml").read_text() == saved   # a refused resume leaves the run's config as it was


def test_resume_reports_what_differs_from_the_runs_config(tmp_path, capsys):
    common = [f"run_dir={tmp_path}", "train.val_every=0", "logging.mode=disabled"]
    run(common + ["train.steps=1"])
    capsys.readouterr()
    run(common + ["train.steps=2", "resume=true", "optim.lr=1e-3", "optim.grad_clip=null", "optim.betas=[0.8,0.9]"])
    out = capsys.readouterr().out
    assert "differs from the run's config.yaml" in out and "optim.lr: 0.003 -> 0.001" in out
    assert "optim.grad_clip: 1.0 -> null" in out and "optim.betas: [0.9, 0.95] -> [0.8, 0.9]" in out  # YAML's words
    assert "train.steps: 1 -> 2" in out and "resume:" not in out.split("differs")[1].split("\n")[0]
    assert OmegaConf.load(tmp_path / "config.yaml").optim.lr == 1e-3   # the resumed run's config is saved
    # nothing left to train: the saved config still describes the checkpoints and stays
    saved = (tmp_path / "config.yaml").read_text()
    run(common + ["train.steps=2", "resume=true", "optim.lr=5e-4", "seed=5"])
    out = capsys.readouterr().out
    assert "not saved: nothing is left to train" in out and "seed: 0 -> 5" in out
    assert (tmp_path / "config.yaml").read_text() == saved


@pytest.mark.parametrize("clip", [1e-3, 1e6])
def test_clipping_scales_the_main_grads_only_when_the_norm_exceeds_grad_clip(tmp_path, clip):
    """After a step the main gradients' global norm is ``grad_clip`` where the step's norm exceeded it
    (clipped in place) and the step's own norm otherwise (the clip pass is skipped, not run at 1.0)."""
    tr = Trainer(compose(QUICK + [f"run_dir={tmp_path}", "logging.mode=disabled", f"optim.grad_clip={clip}"]))
    try:
        rec = tr.train_step()
        after = torch.cat([g.reshape(-1).double() for g in tr.grads.flats]).norm().item()
    finally:
        tr.close()
    norm = rec["grad_norm"]
    assert norm > 1e-3  # the tiny model's first step: clipped at 1e-3, not at 1e6
    expect = clip if norm > clip else norm
    assert after == pytest.approx(expect, rel=1e-4)


def test_resumed_wandb_run_that_holds_later_steps_is_reported(tmp_path, monkeypatch):
    """Resuming from a checkpoint older than the wandb run's last step: W&B will drop the steps trained
    again (it refuses a step below its counter), so the logger says so instead of losing them silently."""
    wandb = pytest.importorskip("wandb")
    from dropless.train.metrics import MetricsLogger

    class FakeRun:
        id, step = "abc123", 41          # the run logged steps 1..40 before it died

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kw: FakeRun())
    (tmp_path / "wandb_run_id").write_text("abc123")
    logging_cfg = check_train_config(compose(["logging.mode=offline"])).logging  # typed, as the trainer passes it
    m = MetricsLogger(tmp_path, logging_cfg, resume=True, start_step=25)
    m.close()
    assert m.note is not None and "steps 26-40" in m.note and "abc123" in m.note
    m = MetricsLogger(tmp_path, logging_cfg, resume=True, start_step=40)  # nothing trained again
    m.close()
    assert m.note is None or "wandb" not in m.note


def test_two_open_loggers_write_two_wandb_runs(tmp_path):
    """A logger opened while another is still open (a trainer not closed, in the same process) gets a
    run of its own in its own run_dir: wandb's default would hand back the open run, and the second
    trainer's records would land silently in the first one's directory."""
    pytest.importorskip("wandb")
    from dropless.train.metrics import MetricsLogger

    dirs = [tmp_path / "a", tmp_path / "b"]
    loggers = []
    logging_cfg = check_train_config(compose(["logging.mode=offline"])).logging  # logging.name null: the run dir's
    for d in dirs:
        d.mkdir()
        loggers.append(MetricsLogger(d, logging_cfg))
    try:
        assert loggers[0].wandb_run.id != loggers[1].wandb_run.id
        assert [m.wandb_run.name for m in loggers] == ["a", "b"]
        for i, m in enumerate(loggers):
            m.log(1, {"loss": float(i)})
    finally:
        for m in reversed(loggers):
            m.close()
    for d in dirs:
        runs = list((d / "wandb").glob("offline-run-*"))
        assert len(runs) == 1 and runs[0].name.endswith((d / "wandb_run_id").read_text())
        assert list(runs[0].glob("*.wandb"))


def test_closed_trainer_releases_its_parameters(tmp_path):
    """After ``close()`` nothing keeps a trainer's parameters alive: its gradient hooks (bound methods
    holding the buckets and every parameter, stored on the C++ side of each parameter, a cycle the
    garbage collector cannot see) are removed, so a second trainer in the same process does not run
    beside the first one's weights and fp32 gradient buckets. Its metrics file and wandb run (offline,
    the default) are closed too: wandb has written the run's ``.wandb`` file."""
    import gc
    import weakref

    tr = Trainer(compose(QUICK + [f"run_dir={tmp_path / 'run'}", "train.steps=1", "train.val_every=0",
                                  "train.ckpt_every=0"]))
    tr.train_step()
    refs = [weakref.ref(p) for p in tr.model.parameters()]
    flat = weakref.ref(tr.grads.flats[0])
    metrics = tr.metrics
    assert metrics.wandb_run is not None and metrics._f is not None
    tr.close()
    assert metrics.wandb_run is None and metrics._f is None
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*/*.wandb"))
    del tr
    gc.collect()
    assert all(r() is None for r in refs) and flat() is None


def test_closed_trainer_refuses_to_train(tmp_path):
    """A step after ``close()`` would run without its gradient hooks (bf16: every main gradient zero,
    the weights still moved by the moments): it raises instead, saying to build a new trainer."""
    tr = Trainer(compose(QUICK + [f"run_dir={tmp_path / 'run'}", "train.steps=2", "train.val_every=0",
                                  "train.ckpt_every=0"]))
    tr.train_step()
    tr.close()
    with pytest.raises(RuntimeError, match="closed"):
        tr.train_step()


def test_start_up_warnings_are_repeated_below_the_resolved_config(tmp_path, capsys):
    """The resolved config (~100 lines) is printed after start-up: a warning printed before it
    scrolls off, so dropless-train prints it again after the config."""
    from dropless.train.__main__ import main

    # 200,000 bytes of text: the last 1 % (2,000 tokens) holds 30 windows of 65, 3 micro-batches of 8, so
    # asking for 4 gives the note, and validation stays short
    src, run_dir = tmp_path / "src", tmp_path / "run"
    src.mkdir()
    rng = random.Random(0)
    (src / "a.py").write_text("".join(rng.choice(string.ascii_letters + " \n") for _ in range(200_000)))
    assert main(QUICK + [f"run_dir={run_dir}", f"data.path={src}", "train.steps=3", "train.val_every=3",
                         "train.val_batches=4", "train.ckpt_every=0", "logging.mode=disabled",
                         "logging.progress=false"]) == 0
    out = capsys.readouterr().out
    cfg_at = out.index("[dropless] resolved config:")
    note = "train.val_batches=4: the validation split holds 3 micro-batch(es)"
    assert out.index(note) < cfg_at                               # as it came, during start-up
    assert out.index(f"[dropless] warning (repeated from start-up): {note}") > cfg_at
    assert out.count(note) == 2
    # the last line gives the run's speed: the median of the steps' own figures
    speeds = sorted(r["tokens_per_s"] for r in records(run_dir) if "tokens_per_s" in r)
    done = [line for line in out.splitlines() if line.startswith("[dropless] done: 3 steps in ")]
    assert len(done) == 1 and len(speeds) == 3
    assert f"; median {speeds[1]:,.0f} tokens/s" in done[0] and " GiB; val_loss " in done[0], done[0]


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_resume_from_a_damaged_checkpoint_names_it_and_the_older_ones(tmp_path, damage):
    from dropless.config import ConfigError

    common = [f"run_dir={tmp_path}", "train.steps=4", "train.val_every=0", "train.ckpt_every=2", "train.ckpt_keep=0",
              "logging.mode=disabled"]
    run(common)
    newest = tmp_path / "checkpoints" / "step_00000004"
    f = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    if damage == "missing":
        f.unlink()
    else:
        f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ConfigError, match=r"step_00000004: ") as e:  # the damaged one, and the older one to use
        Trainer(compose(QUICK + common + ["resume=true", "train.steps=6"]))
    assert "step_00000002" in str(e.value)
    shutil.move(str(newest), str(tmp_path / "aside"))
    summary, tr = run(common + ["resume=true", "train.steps=6"])
    assert tr.resumed_from == 2 and summary["steps"] == 6


def test_a_resume_on_another_rank_count_says_what_changes(tmp_path):
    """The checkpoint's marker records the world size; a resume with another one warns that the data
    order and the tokens per step change (older markers, without the line, say nothing)."""
    from dropless.train import checkpoint as ckpt

    run([f"run_dir={tmp_path}", "train.steps=2", "train.val_every=0", "logging.mode=disabled"])
    step = ckpt.latest_checkpoint(tmp_path)[1]
    assert (step / ckpt.MARKER).read_text() == "step 2\nworld_size 1\n" and ckpt.saved_world_size(step) == 1

    def warnings_of_resume(steps: int = 3) -> list[str]:
        tr = Trainer(compose(QUICK + [f"run_dir={tmp_path}", "resume=true", f"train.steps={steps}",
                                      "logging.mode=disabled"]))
        tr.close()
        return [w for w in tr.warnings if w.startswith("resume:")]

    assert warnings_of_resume() == []
    (step / ckpt.MARKER).write_text("step 2\nworld_size 4\n")  # as a 4-rank job would have written it
    (w,) = warnings_of_resume()
    assert w.startswith("resume: step_00000002 ") and "4 rank(s)" in w and "this run has 1" in w
    assert warnings_of_resume(steps=2) == []  # nothing left to train: no data order to change
    (step / ckpt.MARKER).write_text("step 2\n")  # a checkpoint from before the line existed
    assert warnings_of_resume() == [] and ckpt.saved_world_size(step) is None


def test_progress_bar_shows_each_steps_own_loss(tmp_path, monkeypatch):
    """Each redraw of the bar (``update``) shows the loss of the step it counts, not the one before."""
    shown = []

    class Bar:
        postfix = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def set_postfix(self, refresh=True, **kw):
            self.postfix = kw["loss"]

        def update(self, n):
            shown.append(self.postfix)

    monkeypatch.setattr(Console, "progress", lambda self, total, initial: Bar())
    rd = tmp_path / "run"
    run([f"run_dir={rd}", "train.steps=3", "train.val_every=0", "logging.mode=disabled"])
    assert shown == [f"{r['loss']:.3f}" for r in records(rd) if r["step"] > 0]
