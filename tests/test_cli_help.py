"""``dropless-train --help`` prints plain text (issue 11 item 16: it printed raw reST)."""

from __future__ import annotations

from dropless.train.__main__ import main


def test_help_is_plain_text(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "dropless-train [KEY=VALUE ...]" in out and "checks the config on its own" in out
    assert "Recipes:" in out and "h200_single" in out
    assert "``" not in out and "::" not in out and ":class:" not in out


def test_ctrl_c_while_importing_is_one_line_and_exit_130(monkeypatch, capsys):
    import sys
    import types

    class Interrupting(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt  # as a Ctrl-C lands inside a slow import (torch's takes seconds)

    monkeypatch.setitem(sys.modules, "omegaconf", Interrupting("omegaconf"))
    assert main(["train.steps=1"]) == 130
    err = capsys.readouterr().err
    assert err.strip().startswith("dropless-train: interrupted during start-up") and len(err.strip().splitlines()) == 1


def test_a_second_interrupt_aborts_with_one_line_naming_the_newest_checkpoint(tmp_path, monkeypatch, capsys):
    from dropless.train.trainer import Trainer

    run = tmp_path / "run"
    quick = ["train.micro_batch_size=4", "train.seq_len=32", "optim.warmup_steps=1", "train.val_every=0",
             "logging.progress=false", "logging.mode=disabled", "num_threads=2", f"run_dir={run}"]
    assert main(quick + ["train.steps=2", "train.ckpt_every=2"]) == 0  # a checkpoint at step 2
    capsys.readouterr()
    train = Trainer.train

    def aborted(self):
        self.train_step()
        raise KeyboardInterrupt  # what StopSignals raises at a second Ctrl-C

    monkeypatch.setattr(Trainer, "train", aborted)
    assert main(quick + ["train.steps=4", "resume=true"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]  # the step reached, and the command that continues from the last checkpoint
    assert last.startswith("dropless-train: aborted") and "after step 3" in last
    assert last.endswith(f"resume=true run_dir={run.resolve()} continues from step 2"), last
    monkeypatch.setattr(Trainer, "train", train)


def test_the_console_script_reaches_its_ctrl_c_handler_before_importing_torch():
    """``dropless-train``'s entry imports ``dropless.train.__main__``; the packages above it load their
    names lazily, so torch's seconds-long import happens inside ``main``'s KeyboardInterrupt handler."""
    import subprocess
    import sys

    code = "import sys, dropless.train.__main__; print(sorted(m for m in ('torch', 'omegaconf') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    import dropless

    assert dropless.MoE.__name__ == "MoE" and "Transformer" in dir(dropless)  # the public names still resolve
