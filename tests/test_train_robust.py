"""Issue 11 items 7, 8, 14 on CPU: non-finite steps, determinism, resuming a finished run.

* ``train.nonfinite``: a NaN injected into one micro-batch (the head's input, so the loss is
  NaN; or one parameter's gradient, so only the grad norm is) is caught in the step. ``skip``
  leaves the masters, the AdamW state and the router biases exactly as they were, counts
  ``skipped_steps`` and trains on; ``error`` raises :class:`NonFiniteError` naming the step.
* ``deterministic=true``: two 50-step runs give bitwise-equal losses (local; a2a, agrs, fsdp on
  2 gloo ranks).
* ``resume=true`` of a run that already finished says so.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from dropless.train.config import compose
from dropless.train.trainer import NonFiniteError, Trainer
from tests.test_train import QUICK, _env, records, run

BASE = QUICK + ["logging.mode=disabled", "train.val_every=0", "train.grad_accum=2"]


def _poison_output(tr, on_call: int):
    """NaN in the head's input (the final norm's output) on the ``on_call``-th forward from now (1-based)."""
    calls = [0]

    def hook(mod, args, out):
        calls[0] += 1
        return out * float("nan") if calls[0] == on_call else None
    return tr.model.norm.register_forward_hook(hook)


def _poison_grad(tr, on_call: int):
    """NaN in the head weight's gradient on the ``on_call``-th backward from now."""
    calls = [0]

    def hook(g):
        calls[0] += 1
        return g * float("nan") if calls[0] == on_call else None
    return tr.model.output.weight.register_hook(hook)


def _snapshot(tr):
    opt = {k: {n: v.clone() for n, v in st.items()} for k, st in enumerate(tr.optimizer.state.values())}
    bias = [r.e_score_correction_bias.clone() for r in tr.balancer.routers]
    return [m.clone() for m in tr.masters.masters], opt, bias


def _same(a, b) -> bool:
    (ma, oa, ba), (mb, ob, bb) = a, b
    return (all(torch.equal(x, y) for x, y in zip(ma, mb)) and all(torch.equal(x, y) for x, y in zip(ba, bb))
            and all(torch.equal(oa[k][n], ob[k][n]) for k in oa for n in oa[k]))


@pytest.mark.parametrize("poison", [_poison_output, _poison_grad])
def test_nonfinite_skip_leaves_weights_and_moments(tmp_path, poison):
    tr = Trainer(compose(BASE + [f"run_dir={tmp_path}", "train.steps=4", "train.nonfinite=skip"]))
    try:
        r1 = tr.train_step()
        assert r1["skipped_steps"] == 0 and math.isfinite(r1["loss"])
        before = _snapshot(tr)
        h = poison(tr, on_call=2)                  # second micro-batch of step 2
        r2 = tr.train_step()
        h.remove()
        assert r2["skipped_steps"] == 1 and not math.isfinite(r2["grad_norm"])
        assert _same(before, _snapshot(tr))         # masters, moments, router biases untouched
        assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(tr.masters.compute, tr.masters.masters))
        assert all(r.tokens_per_expert.abs().sum() == 0 for r in tr.balancer.routers)   # counts discarded
        r3 = tr.train_step()
        assert r3["skipped_steps"] == 1 and math.isfinite(r3["loss"]) and math.isfinite(r3["grad_norm"])
        assert not _same(before, _snapshot(tr))     # the next step trains again
        assert all(torch.isfinite(m).all() for m in tr.masters.masters)
    finally:
        tr.close()


def test_nonfinite_error_names_the_step(tmp_path):
    tr = Trainer(compose(BASE + [f"run_dir={tmp_path}", "train.steps=4"]))   # default: error
    try:
        tr.train_step()
        before = _snapshot(tr)
        _poison_output(tr, on_call=1)
        with pytest.raises(NonFiniteError, match=r"step 2: non-finite training loss \(nan\)"):
            tr.train_step()
        assert _same(before, _snapshot(tr))
    finally:
        tr.close()


def test_bad_nonfinite_value_is_a_config_error():
    from dropless.config import ConfigError
    with pytest.raises(ConfigError, match="train.nonfinite"):
        Trainer(compose(BASE + ["train.nonfinite=ignore"]))


def _losses(rd) -> list[float]:
    return [r["loss"] for r in sorted((x for x in records(rd) if "loss" in x), key=lambda x: x["step"])]


def test_deterministic_runs_are_bitwise_equal_local(tmp_path):
    small = ["deterministic=true", "train.steps=50", "train.micro_batch_size=2", "train.seq_len=32",
             "train.grad_accum=1", "train.ckpt_every=0"]
    try:
        run([f"run_dir={tmp_path / 'a'}", "logging.mode=disabled", "train.val_every=0", *small])
        run([f"run_dir={tmp_path / 'b'}", "logging.mode=disabled", "train.val_every=0", *small])
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(a) == 50 and a == b


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["a2a", "agrs", "fsdp"])
def test_deterministic_runs_are_bitwise_equal_two_ranks(tmp_path, dispatcher):
    def train(rd):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "dropless.train", *QUICK, "num_threads=1", f"dispatcher={dispatcher}",
                            "deterministic=true", "train.steps=50", "train.micro_batch_size=2", "train.seq_len=32",
                            "train.val_every=0", "train.ckpt_every=0", "logging.mode=disabled", f"run_dir={rd}"],
                           capture_output=True, text=True, env=_env(), timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return _losses(rd)
    a, b = train(tmp_path / "a"), train(tmp_path / "b")
    assert len(a) == 50 and a == b


def test_resuming_a_finished_run_says_so(tmp_path, capsys):
    common = [f"run_dir={tmp_path}", "train.steps=2", "train.val_every=1", "logging.mode=disabled"]
    run(common)
    capsys.readouterr()
    summary, tr = run(common + ["resume=true"])
    out = capsys.readouterr().out
    assert summary["steps"] == 2 and tr.resumed_from == 2
    said = next(line for line in out.splitlines() if "already finished" in line)
    assert "step 2" in said and "train.steps=2" in said and "nothing to train" in out and "val_every=0" not in out


def test_cli_divergence_exits_3_and_skip_says_so(tmp_path, capsys):
    """dropless-train with a learning rate that blows the weights up: exit 3 with the step named (no
    traceback); with train.nonfinite=skip the router lets the non-finite logits through, each
    skipped step is printed, and the run, which skipped its last 3 steps with no validation to
    show the final weights are sound, also exits 3 with the count (it used to exit 0)."""
    from dropless.train.__main__ import main

    common = ["optim.lr=1e12", "optim.warmup_steps=1", "train.steps=4", "logging.mode=disabled", "train.val_every=0",
              "logging.progress=false", "train.ckpt_every=0", "num_threads=1"]
    assert main(common + [f"run_dir={tmp_path / 'a'}"]) == 3
    out, err = capsys.readouterr()
    # the router's logits go non-finite first here (the router's own check), the step named either way
    assert "step 2: " in err and "non-finite" in err and "Traceback" not in err
    assert main(common + [f"run_dir={tmp_path / 'b'}", "train.nonfinite=skip"]) == 3
    out, err = capsys.readouterr()
    assert "optimizer step skipped (train.nonfinite=skip" in out and "3 optimizer steps skipped: non-finite" in out
    said = next(line for line in err.splitlines() if line.startswith("dropless-train: error: "))
    # the option, the count of skipped steps, the last step among them, and why no validation clears it
    assert all(f in said for f in ("train.nonfinite=skip", "3 of 4", "(4)", "train.val_every=0")), said
    assert "Traceback" not in err


def test_cli_nonfinite_validation_loss_is_not_a_success(tmp_path, capsys):
    """optim.lr=1e6: step 2's training loss is finite, but the weights it leaves give a NaN validation loss.
    nonfinite=error: exit 3 naming step 2's validation (it used to name step 3, from the router's check
    inside validation); skip: a warning at each such validation, and exit 3 at the end (it used to exit
    0 with ``val_loss ... -> nan``), after the last checkpoint is written."""
    from dropless.train.__main__ import main

    common = ["optim.lr=1e6", "optim.warmup_steps=0", "train.steps=4", "train.val_every=2", "logging.mode=disabled",
              "logging.progress=false", "train.ckpt_every=0", "num_threads=1"]
    assert main(common + [f"run_dir={tmp_path / 'a'}"]) == 3
    out, err = capsys.readouterr()
    said = next(line for line in err.splitlines() if line.startswith("dropless-train: error: "))
    assert said.startswith("dropless-train: error: step 2: ") and "validation" in said and "optim.lr" in said
    assert "step 0 val_loss" in out and "step 2 loss" not in out
    assert main(common + [f"run_dir={tmp_path / 'b'}", "train.nonfinite=skip"]) == 3
    out, err = capsys.readouterr()
    warned = [line for line in out.splitlines() if "WARNING: step" in line and "validation" in line]
    assert [w.split("WARNING: step ")[1].split(":")[0] for w in warned] == ["2", "4"]
    assert all("train.nonfinite=skip" in w and "exit status 3" in w for w in warned), warned
    said = next(line for line in err.splitlines() if line.startswith("dropless-train: error: "))
    assert all(f in said for f in ("train.nonfinite=skip", "2 of 4", "steps 2, 4", "step 4")), said
    assert [r.get("val_loss") for r in records(tmp_path / "b") if "val_loss" in r] == [pytest.approx(5.6095, abs=1e-3),
                                                                                    None, None]
    assert (tmp_path / "b" / "checkpoints" / "step_00000004").is_dir()


def _poison_steps(tr, steps):
    """NaN in the head's input during the training forwards of the given steps (1-based), not in validation."""
    def hook(mod, args, out):
        return out * float("nan") if mod.training and tr.step + 1 in steps else None
    return tr.model.norm.register_forward_hook(hook)


@pytest.mark.parametrize("val_every, poisoned, diverged", [
    (0, {1, 2, 3}, "every optimizer step of the run (3) was skipped for a non-finite loss or gradient norm: "
                   "nothing was trained"),
    (0, {3}, "1 of 3 optimizer steps were skipped for a non-finite loss or gradient norm; the last step (3) "
             "among them, with no validation (train.val_every=0) to show that the final weights give a finite loss"),
    (0, {2}, None),    # a skipped step the run recovered from: a success
    (3, {3}, None),    # the last step skipped, and the validation after it shows the weights are sound
])
def test_skip_run_verdict(tmp_path, val_every, poisoned, diverged):
    """Trainer.train()'s ``diverged`` under train.nonfinite=skip: every step skipped, or the last skipped with
    nothing after it to vouch for the weights, is named; an isolated skipped step is not."""
    tr = Trainer(compose(BASE + [f"run_dir={tmp_path}", "train.steps=3", "train.nonfinite=skip",
                                 f"train.val_every={val_every}"]))
    try:
        _poison_steps(tr, poisoned)
        summary = tr.train()
    finally:
        tr.close()
    assert tr.skipped_steps == len(poisoned)
    if diverged is None:
        assert summary["diverged"] is None
    else:
        said = summary["diverged"]  # the option, what diverged, the checkpoint to use and what to lower
        assert all(f in said for f in ("train.nonfinite=skip", diverged, "step 3", "optim.lr")), said


def test_state_that_cannot_fit_is_refused_before_the_run_dir(tmp_path, monkeypatch):
    """A model whose weights, main gradients and AdamW state alone exceed the process's memory: a
    ConfigError naming the sizes and the fix before the model is built or the run dir made (before,
    ``recipe=h200_single device=cpu`` on a 24 GiB machine was OOM-killed while building)."""
    from dropless.config import ConfigError
    from dropless.model.params import param_counts
    from dropless.train import startup
    from dropless.train.config import model_args
    from dropless.train.dist import DistEnv

    cfg = compose(QUICK + [f"run_dir={tmp_path / 'r'}", "logging.mode=disabled"])
    n = param_counts(model_args(cfg)).total
    monkeypatch.setattr(startup, "process_memory_bytes", lambda env: n * 16 - 1)   # fp32: 16 bytes a parameter
    with pytest.raises(ConfigError, match=r"need at least .* GiB per process .*model=tiny"):
        Trainer(cfg)
    assert not (tmp_path / "r").exists()
    monkeypatch.undo()
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                  ep_size=1, dp_size=1)
    startup.check_state_fits(n, torch.float32, env, have=n * 16)          # exactly fits
    with pytest.raises(ConfigError, match="18 bytes a parameter at bfloat16"):
        startup.check_state_fits(n, torch.bfloat16, env, have=n * 16)
    env4 = DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4, device=torch.device("cpu"),
                   ep_size=4, dp_size=1)
    startup.check_state_fits(4 * n, torch.float32, env4, have=n * 16)     # shared by 4 ranks
    assert startup.process_memory_bytes(env4) * 4 <= startup.process_memory_bytes(env) + 3   # the node's share


def test_async_checkpoint_staging_that_cannot_fit_is_refused_before_the_run_dir(tmp_path, monkeypatch):
    """``train.ckpt_async=true`` copies the saved state (fp32 masters and AdamW moments) into
    host memory at every save: where the host cannot hold it, a ConfigError at start-up naming the
    option, not an OOM kill at the first save ``train.ckpt_every`` steps in."""
    from dropless.config import ConfigError
    from dropless.model.params import param_counts
    from dropless.train import startup
    from dropless.train.config import model_args
    from dropless.train.dist import DistEnv

    cfg = compose(QUICK + [f"run_dir={tmp_path / 'r'}", "logging.mode=disabled", "train.ckpt_async=true"])
    n = param_counts(model_args(cfg)).total
    # fp32 on a CPU: 16 bytes of training state + 12 staged a parameter
    monkeypatch.setattr(startup, "process_memory_bytes", lambda env: n * 28 - 1)
    with pytest.raises(ConfigError, match=r"train.ckpt_async=true copies .* train.ckpt_async=false"):
        Trainer(cfg)
    assert not (tmp_path / "r").exists()
    cpu = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                  ep_size=1, dp_size=1)
    startup.check_state_fits(n, torch.float32, cpu, have=n * 28, async_staging=True)    # exactly fits
    startup.check_state_fits(n, torch.float32, cpu, have=n * 16)                         # synchronous saves
    gpu = dataclasses.replace(cpu, device=torch.device("cuda", 0))  # the GPU holds the state, the host the copy
    startup.check_state_fits(n, torch.bfloat16, gpu, have=n * 18, async_staging=True, host_have=n * 12)
    with pytest.raises(ConfigError, match="host memory per process"):
        startup.check_state_fits(n, torch.bfloat16, gpu, have=n * 18, async_staging=True, host_have=n * 12 - 1)


def test_deepep_without_its_package_fails_before_the_run_dir(tmp_path):
    """``dispatcher=deepep`` where ``deep_ep`` does not import: the ConfigError saying how to install it
    comes before the config is printed and the run dir made (it came from the model build, after both)."""
    try:
        import deep_ep  # noqa: F401
        pytest.skip("deep_ep is installed")
    except ImportError:
        pass
    from dropless.config import ConfigError
    with pytest.raises(ConfigError, match="cannot import deep_ep"):
        Trainer(compose(QUICK + [f"run_dir={tmp_path / 'r'}", "logging.mode=disabled", "dispatcher=deepep"]))
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("bad,match", [("model.tie_word_embeddings=true", r"^model\.tie_word_embeddings="),
                                       ("init_from=/nonexistent/dir", "not a Hugging Face model directory")])
def test_config_errors_come_before_the_run_dir(tmp_path, bad, match):
    """A tied head and an init_from that is none of the known kinds are errors of the config alone: raised
    by check_train_config, before the run dir is made (they came from the model build and the weight
    load, leaving an empty run dir; found by a new-user trial)."""
    from dropless.config import ConfigError
    from dropless.train.startup import check_train_config
    cfg = compose(QUICK + [f"run_dir={tmp_path / 'r'}", "logging.mode=disabled", bad])
    with pytest.raises(ConfigError, match=match):
        check_train_config(cfg)
    with pytest.raises(ConfigError, match=match):
        Trainer(cfg)
    assert not (tmp_path / "r").exists()


def test_a_run_that_ends_inside_the_warmup_is_warned_about(capsys):
    """optim.warmup_steps >= train.steps: valid but rarely meant (the lr never reaches optim.lr nor
    decays): a warning naming both values and how far the lr gets; none otherwise."""
    from dropless.train.startup import schedule_note
    note = schedule_note(compose(QUICK + ["train.steps=20", "optim.warmup_steps=50", "optim.lr=0.003"]))
    assert note.startswith("optim.warmup_steps=50 >= train.steps=20") and "40% of optim.lr=0.003" in note
    assert schedule_note(compose(QUICK + ["train.steps=20", "optim.warmup_steps=19"])) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_gpu_recipe_without_cuda_points_to_the_cpu_recipe(tmp_path):
    """recipe=h200_single where torch sees no GPU: the error says the recipe is sized for GPUs and names
    the CPU recipe (plain "set device=cpu" led to the memory error of its 1.88 B model)."""
    from dropless.config import ConfigError
    with pytest.raises(ConfigError, match=r"^device=cuda \(recipe=h200_single\).*cpu_default"):
        Trainer(compose(["recipe=h200_single", f"run_dir={tmp_path / 'r'}", "logging.mode=disabled"]))
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match=r"set device=cpu \(or auto\)$"):   # no recipe: the plain advice
        Trainer(compose(QUICK + ["device=cuda", f"run_dir={tmp_path / 'r'}", "logging.mode=disabled"]))


def test_more_threads_than_cores_is_warned_about():
    """``num_threads`` times the node's processes above the usable cores: a warning naming both and the
    fix (``num_threads=1000`` on 2 cores ran ≈ 60× slower, silently); none for null or a count that fits."""
    from dropless.train.dist import DistEnv
    from dropless.train.startup import threads_note

    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"),
                  ep_size=1, dp_size=2)
    note = threads_note(compose(["num_threads=3"]), env, cores=4)
    assert note is not None and "num_threads=3 x 2 process(es)" in note and "the 4 core(s)" in note
    assert "num_threads=null (the cores shared out: 2 each)" in note
    assert threads_note(compose(["num_threads=2"]), env, cores=4) is None
    assert threads_note(compose(["num_threads=null"]), env, cores=1) is None


def test_ctrl_c_during_start_up_exits_130_with_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the trainer is being built (data, model) ends with exit status 130 and one line
    saying nothing was trained or saved, not a KeyboardInterrupt traceback; the run dir holds no checkpoint."""
    from dropless.train import checkpoint as ckpt
    from dropless.train.__main__ import main

    built = []

    def interrupted(self, cfg):
        built.append(cfg.run_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "__init__", interrupted)
    assert main([*QUICK, f"run_dir={tmp_path}", "logging.mode=disabled"]) == 130
    err = capsys.readouterr().err
    assert built == [str(tmp_path)]
    assert "interrupted during start-up" in err and "nothing was trained or saved" in err
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_out_of_gpu_memory_in_a_step_is_one_line_naming_what_to_lower(tmp_path, monkeypatch, capsys):
    """torch's allocator error (a page of text, then a traceback) becomes one line: the step, the
    allocator's first sentence and the settings that lower the peak, with their current values."""
    from dropless.train.__main__ import main

    def oom(self, x, y):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.88 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 1.2 GiB is free.\nIf reserved but unallocated ...")

    real = Trainer._loss
    monkeypatch.setattr(Trainer, "_loss", oom)  # the forward of the first micro-batch
    rc = main(QUICK + [f"run_dir={tmp_path}", "train.steps=3", "train.val_every=0", "logging.mode=disabled",
                       "train.micro_batch_size=4"])
    err = capsys.readouterr().err
    assert rc == 2
    line = [x for x in err.splitlines() if x.startswith("dropless-train: error: out of GPU memory")]
    assert len(line) == 1 and "Traceback" not in err, err
    assert "at step 1 (CUDA out of memory" in line[0] and "Tried to allocate 7.88 GiB" in line[0]
    assert "train.micro_batch_size (now 4;" in line[0] and "train.activation_checkpointing=true" in line[0]
    assert "If reserved" not in line[0] and "no checkpoint" in line[0] and line[0].endswith("step 0"), line[0]
    # after a checkpoint, the line names the one a resume starts from
    monkeypatch.setattr(Trainer, "_loss", lambda self, x, y: oom(self, x, y) if self.step >= 2 else real(self, x, y))
    assert main(QUICK + [f"run_dir={tmp_path / 'b'}", "train.steps=4", "train.ckpt_every=2", "train.val_every=0",
                         "logging.mode=disabled", "train.micro_batch_size=4"]) == 2
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("dropless-train: error: out of GPU")]
    assert "at step 3 (" in line[0] and line[0].endswith("resume=true continues from step_00000002 (step 2)"), line


def test_out_of_gpu_memory_at_start_up_is_one_line(tmp_path, monkeypatch, capsys):
    from dropless.train import trainer as trainer_module
    from dropless.train.__main__ import main

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 0.5 GiB is free. Including non-PyTorch memory ...")

    monkeypatch.setattr(trainer_module, "build_model", oom)
    assert main(QUICK + [f"run_dir={tmp_path}", "logging.mode=disabled"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next(x for x in err.splitlines() if x.startswith("dropless-train: error: out of GPU memory"))
    assert "during start-up" in line and "Tried to allocate 3.00 GiB" in line and "0.5 GiB is free" in line
    assert "dispatcher=fsdp" in err and "nothing was trained or saved" in err and "Including" not in err


def test_config_error_under_torchrun_restarts_says_restarts_repeat_it(monkeypatch, capsys, tmp_path):
    """torchrun --max-restarts 2 restarts the workers after an error: a config error comes back at
    every start, so the message says which start this is and that restarts cannot help."""
    from dropless.train.__main__ import main

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    for count, tail in (("0", "[torchrun start 1 of at most 3: a restart meets this error again; stop the job "
                              "(Ctrl-C) instead of waiting for the 2 restart(s) left]"),
                        ("2", "[torchrun start 3 of at most 3: a restart meets this error again]")):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
        assert main([f"run_dir={tmp_path / 'x'}", "train.steps=-1"]) == 2
        err = capsys.readouterr().err
        assert "train.steps=-1: must be a positive integer" in err and err.rstrip().endswith(tail), err
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert main(["train.steps=-1"]) == 2 and "torchrun start" not in capsys.readouterr().err
