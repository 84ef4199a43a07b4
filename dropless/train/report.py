"""A start-up error of a job, reported once: rank 0 prints it, the other ranks exit with its status.

Every rank of a job composes the same config from the same command line, so a bad value fails on
every rank with the same message; printed by each, it came once per rank. :func:`report_error`
prints it on rank 0 only. Under torchrun the other ranks first wait for rank 0 to say (through
torchrun's own key-value store, ``TORCHELASTIC_USE_AGENT_STORE``) that it printed the same
message: torchrun stops the whole job when its first worker exits, so a rank that exited before
rank 0 had printed would leave no message at all. A rank whose error differs from rank 0's (a
file missing on one node, say), or that hears nothing from rank 0 within :data:`WAIT_S`, prints
its own, naming its rank.

Under torchrun each rank also writes torchrun's error file (``TORCHELASTIC_ERROR_FILE``, the JSON
of :class:`torch.distributed.elastic.multiprocessing.errors.ErrorHandler`), so the failure summary
torchrun prints last shows, for each rank, a line pointing at dropless's message above it instead
of torchrun's placeholder (a link to the ``@record`` documentation).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

__all__ = ["report_error", "WAIT_S"]

#: seconds a rank other than 0 waits for rank 0's word before printing its own error
WAIT_S = 30.0


def _agent_store(timeout_s: float) -> dist.Store | None:
    """torchrun's key-value store (the agent's, which its workers may use), or None outside
    torchrun or when it cannot be reached."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (KeyError, ValueError, RuntimeError):
        return None


def _key(status: int) -> str:
    return f"dropless/start_error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{status}"


def _same_as_rank0(message: str, status: int) -> bool:
    """Whether rank 0 reported ``message`` with ``status`` within :data:`WAIT_S` (torchrun only)."""
    store = _agent_store(WAIT_S)
    if store is None:
        return False
    try:
        store.wait([_key(status)], datetime.timedelta(seconds=WAIT_S))
        return store.get(_key(status)).decode() == message
    except RuntimeError:  # no word from rank 0 in time (it runs on, or died)
        return False


def _write_error_file(status: int) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    note = (f"dropless-train: exit status {status}: the 'dropless-train: error:' line above (printed once, by "
            "rank 0, unless a rank's own differs) says what to change")
    data = {"message": {"message": note, "extraInfo": {"py_callstack": note, "timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass  # torchrun's summary shows its own placeholder


def report_error(message: str, rank: int, status: int) -> int:
    """Print ``dropless-train: error: <message>`` once per job (see the module doc); returns ``status``.

    Args:
        message: the error, as every rank would print it.
        rank: this process's global rank (``RANK``; 0 outside torchrun).
        status: the exit status the caller returns (2: bad config or data).
    """
    if rank == 0:
        print(f"dropless-train: error: {message}", file=sys.stderr, flush=True)
        store = _agent_store(5.0)
        if store is not None:
            try:
                store.set(_key(status), message)
            except RuntimeError:
                pass  # the other ranks then print their own after WAIT_S
    elif not _same_as_rank0(message, status):
        print(f"dropless-train: error (rank {rank}): {message}", file=sys.stderr, flush=True)
    _write_error_file(status)
    return status
