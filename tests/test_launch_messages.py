"""What a launch prints once: a config error under torchrun (rank 0's line, the other ranks quiet,
torchrun's summary pointing at it) and the warning of an expert-parallel dispatcher at EP = 1."""

from __future__ import annotations

import datetime
import re
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from dropless.train.__main__ import main
from tests.test_train import QUICK, _env


def _torchrun(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "dropless.train", *QUICK, "num_threads=1", f"run_dir={tmp_path / 'r'}",
                           "logging.mode=disabled", *overrides],
                          capture_output=True, text=True, env=_env(), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("bad, field", [(["train.stepz=3"], "train.stepz"),          # a key that does not exist
                                        (["train.steps=-1"], "train.steps=-1"),      # a value out of range
                                        (["dispatcher=a2a", "dispatcher.ep_size=4"], "dispatcher.ep_size=4")])
def test_config_error_under_torchrun_is_printed_once(tmp_path, bad, field):
    r = _torchrun(tmp_path, *bad)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    said = re.findall(r"^dropless-train: error.*$", out, flags=re.MULTILINE)
    assert len(said) == 1, out[-4000:]                                  # rank 0's line, rank 1 quiet
    assert said[0].startswith("dropless-train: error: ") and field in said[0], said   # names the field
    # torchrun's summary: the first failure exited with the config-error status, and every rank's
    # entry points at dropless's line instead of at the @record documentation
    root = out.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(r"exitcode\s*:\s*2 ", root), root
    assert "To enable traceback see" not in out
    assert "dropless-train: exit status 2" in root
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.fixture
def agent_store(monkeypatch):
    """A key-value store where torchrun's agent keeps its own, with the environment its workers get."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("localhost", port, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    for k, v in {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "localhost", "MASTER_PORT": str(port),
                 "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    yield store


def test_other_ranks_print_only_an_error_rank0_did_not(agent_store, capsys, monkeypatch):
    """Rank 0 prints and tells the store; a rank with the same message stays quiet; a rank whose
    message differs, or that hears nothing from rank 0 in time, prints its own, naming its rank."""
    from dropless.train import report

    assert report.report_error("train.steps=-1: must be a positive integer", 0, 2) == 2
    assert capsys.readouterr().err == "dropless-train: error: train.steps=-1: must be a positive integer\n"
    assert report.report_error("train.steps=-1: must be a positive integer", 1, 2) == 2
    assert capsys.readouterr().err == ""
    assert report.report_error("data.path=/x: no such file", 1, 2) == 2
    assert capsys.readouterr().err == "dropless-train: error (rank 1): data.path=/x: no such file\n"
    monkeypatch.setattr(report, "WAIT_S", 0.5)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")            # a restart: rank 0 has said nothing yet
    assert report.report_error("train.steps=-1: must be a positive integer", 1, 2) == 2
    assert "(rank 1): train.steps=-1" in capsys.readouterr().err


def test_config_error_writes_torchruns_error_file(tmp_path, monkeypatch, capsys):
    """The error file (torchrun's ErrorHandler JSON) names the exit status; torchrun's summary shows it."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    f = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(f))
    assert main(["train.steps=-1"]) == 2
    assert "train.steps=-1: must be a positive integer" in capsys.readouterr().err
    json.loads(f.read_text())
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(f))
    assert "dropless-train: exit status 2" in failure.message["extraInfo"]["py_callstack"]


@pytest.mark.parametrize("dispatcher", ["a2a", "agrs"])
def test_an_expert_parallel_dispatcher_in_one_process_is_warned_about_once(tmp_path, capsys, dispatcher):
    """dispatcher=a2a (agrs, deepep) in one process is EP = 1: it trains as local, said once at start-up
    (and once more in dropless-train's repeat of the start-up warnings below the resolved config)."""
    assert main(QUICK + [f"dispatcher={dispatcher}", "train.steps=1", "train.val_every=0", "train.ckpt_every=0",
                         "logging.mode=disabled", f"run_dir={tmp_path / 'r'}"]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if f"dispatcher={dispatcher}: one process runs EP = 1" in line]
    assert len(said) == 2, out
    assert said[0].startswith("[dropless] warning: ") and "torchrun --nproc_per_node N" in said[0]
    assert said[1].startswith("[dropless] warning (repeated from start-up): ")
    assert "dispatcher=local" in said[0]


def test_local_dispatcher_and_ep_over_processes_are_not_warned_about():
    from dropless.dispatch.a2a import A2ADispatcher
    from dropless.dispatch.fsdp import FSDPDispatcher
    from dropless.dispatch.local import LocalDispatcher
    from dropless.train.dist import DistEnv
    from dropless.train.startup import dispatcher_note

    def env(world, ep):
        return DistEnv(0, world, 0, world, None, ep, world // ep)

    assert dispatcher_note(LocalDispatcher, env(1, 1)) is None
    assert dispatcher_note(FSDPDispatcher, env(2, 1)) is None  # EP 1 by design
    assert dispatcher_note(A2ADispatcher, env(2, 2)) is None
    note = dispatcher_note(A2ADispatcher, env(2, 1))
    assert note.startswith("dispatcher=a2a: dispatcher.ep_size=1 over 2 processes")
