"""``train.dist_backend`` and the start-up checks of the process group (CPU).

* :func:`dropless.train.dist.resolve_dist_backend`: ``auto`` is nccl on CUDA and gloo on the CPU;
  nccl with more local ranks than GPUs, or on the CPU, and an unknown value are errors naming
  ``train.dist_backend`` (the GPU count is given, so no GPU is needed); gloo on CUDA is allowed.
* The config check (``--cfg`` and the run's start) refuses an unknown value by name.
* :func:`dropless.dispatch.mesh.check_same_device`: two ranks that disagree on the device type
  (one cpu, one cuda) both raise, naming each rank's device, instead of waiting for each other;
  through :func:`~dropless.dispatch.mesh.start_process_group` under a torchrun-like environment
  too (two processes, before any group exists).
* ``dropless-train`` under torchrun with ``device=cpu train.dist_backend=nccl``: a non-zero exit,
  the message names the option, nothing trained.
The GPU side (gloo ranks sharing one GPU, the NCCL refusal on one GPU) is in ``tests/test_gpu_ranks.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dropless.config import ConfigError
from dropless.dispatch.mesh import check_same_device, start_process_group
from dropless.train.config import compose
from dropless.train.dist import resolve_dist_backend
from dropless.train.startup import check_train_config
from tests.test_train import _env

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize("want,device,local,gpus,expect", [
    ("auto", CPU, 4, 0, "gloo"), ("auto", CUDA, 2, 2, "nccl"), ("gloo", CUDA, 4, 1, "gloo"),
    ("gloo", CPU, 2, 0, "gloo"), ("nccl", CUDA, 8, 8, "nccl")])
def test_resolve_dist_backend(want, device, local, gpus, expect):
    assert resolve_dist_backend(want, device, local, gpus) == expect


def test_nccl_with_more_local_ranks_than_gpus_names_the_option():
    for want in ("auto", "nccl"):
        with pytest.raises(ConfigError, match=r"one GPU per rank.*train\.dist_backend=gloo"):
            resolve_dist_backend(want, CUDA, 2, 1)


def test_nccl_on_the_cpu_and_unknown_values_are_refused():
    with pytest.raises(ConfigError, match=r"train\.dist_backend=nccl"):
        resolve_dist_backend("nccl", CPU, 1, 0)
    with pytest.raises(ConfigError, match=r"train\.dist_backend='mpi'"):  # the schema's rule
        check_train_config(compose(["train.dist_backend=mpi", "device=cpu"]))
    check_train_config(compose(["train.dist_backend=gloo", "device=cpu"]))  # a valid value passes


def _agree(devices: list[torch.device]) -> list[object]:
    """check_same_device on len(devices) threads sharing one store; each thread's error or None."""
    store = dist.HashStore()
    out: list[object] = [None] * len(devices)

    def run(r):
        try:
            check_same_device(store, r, len(devices), devices[r], "gloo")
        except ConfigError as err:
            out[r] = err
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return out


def test_ranks_on_different_device_types_all_raise():
    errs = _agree([CPU, CUDA])
    for e in errs:
        assert isinstance(e, ConfigError)
        assert "rank 0: cpu" in str(e) and "rank 1: cuda" in str(e) and "device=" in str(e)
    assert _agree([CUDA, torch.device("cuda", 1)]) == [None, None]  # the same type on other GPUs agrees


class _SlowReads:
    """A store whose reads take ``delay`` seconds and are logged to ``events`` once returned."""

    def __init__(self, store, delay, events, name):
        self.store, self.delay, self.events, self.name = store, delay, events, name

    def set(self, key, value):
        self.store.set(key, value)

    def get(self, key):
        time.sleep(self.delay)
        got = self.store.get(key)
        self.events.append(f"{self.name} read {key}")
        return got

    def wait(self, keys):
        self.store.wait(keys)


def test_no_rank_raises_before_every_rank_has_read_every_device():
    """Without torchrun rank 0's process holds the store: had it raised (and exited) while rank 1 still read,
    rank 1's read would fail with a connection error instead of the disagreement."""
    store, events = dist.HashStore(), []
    slow = _SlowReads(store, 0.5, events, "rank 1")
    fast = _SlowReads(store, 0.0, events, "rank 0")
    errs = [None, None]

    def run(r, st, dev):
        try:
            check_same_device(st, r, 2, dev, "gloo")
        except ConfigError as err:
            errs[r] = err
            events.append(f"rank {r} raised")
    threads = [threading.Thread(target=run, args=(1, slow, CUDA)), threading.Thread(target=run, args=(0, fast, CPU))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(e, ConfigError) for e in errs), errs
    assert events.index("rank 1 read device/1") < events.index("rank 0 raised"), events


def _start(rank, port, devices, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    try:
        start_process_group(devices[rank], 30, backend="gloo")
        q.put((rank, "started"))
    except ConfigError as err:
        q.put((rank, str(err)))


@pytest.mark.slow
def test_start_process_group_refuses_mixed_devices_before_making_the_group():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_start, args=(r, port, ["cuda:0", "cpu"], q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=240) for _ in range(2))  # two spawned interpreters importing torch on a busy machine
    for p in procs:
        p.join(30)
    for r in range(2):
        assert "disagree" in got[r] and "rank 0: cuda" in got[r] and "rank 1: cpu" in got[r], got[r]


@pytest.mark.slow
def test_torchrun_nccl_on_the_cpu_is_refused_before_training(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "dropless.train", "device=cpu", "train.dist_backend=nccl", "train.steps=2",
                        "logging.mode=disabled", f"run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode != 0
    assert "train.dist_backend=nccl runs on CUDA devices only" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
