"""The multi-rank test harness itself: a failing world reports every rank, never hangs."""

from __future__ import annotations

import time

import pytest

from tests import dist_harness as H


@pytest.mark.slow
def test_failure_reports_the_error_and_the_waiting_peer_stack():
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as err:
        H.run_world("stuck_peer_worker", 2, pg_timeout_s=3.0, deadline_s=60.0)
    msg = str(err.value)
    assert time.monotonic() - t0 < 45, "the harness waited for the busy rank to finish"
    assert "exit codes {0: 1}" in msg
    assert "--- rank 0 raised:" in msg and "barrier" in msg.split("--- rank 0 raised:")[1]
    peer = msg.split("--- rank 1 was still running; its stack:")[1]       # where the peer was
    assert "stuck_peer_worker" in peer and "dist_harness.py" in peer
