"""One ``dropless-train`` rank under torchrun, with a fault injected for the fault tests.

Run as ``python -m torch.distributed.run ... tests/fault_rank.py OVERRIDES...``; every rank
calls :func:`dropless.train.__main__.main` with the overrides. The fault comes from the
environment (set by the test, read here only), on rank ``FAULT_RANK`` (or each of the ranks
of a comma-separated list, e.g. ``1,2,3``) of the first start (``TORCHELASTIC_RESTART_COUNT`` 0):

* ``FAULT=stall``: before optimizer step ``FAULT_STEP`` the rank sleeps forever (it stops
  taking part, without dying); the first rank of the list first writes the time to
  ``FAULT_MARK``.
* ``FAULT=kill_in_save``: in the checkpoint save of step ``FAULT_STEP``, after this rank's
  DCP files are written and before the save completes, the rank SIGKILLs itself.

Every rank writes its pid to ``FAULT_PID_DIR/rank{R}.start{N}`` (if set), so a test can kill
it from outside.
"""

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp

from dropless.train import checkpoint
from dropless.train.__main__ import main
from dropless.train.trainer import Trainer

rank = int(os.environ.get("RANK", "0"))
start = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if os.environ.get("FAULT_PID_DIR"):
    Path(os.environ["FAULT_PID_DIR"], f"rank{rank}.start{start}").write_text(str(os.getpid()))
faulthandler.dump_traceback_later(float(os.environ.get("FAULT_DUMP_AFTER_S", "300")), exit=False)  # a hang shows where
fault, at = os.environ.get("FAULT", ""), int(os.environ.get("FAULT_STEP", "-1"))
fault_ranks = [int(r) for r in os.environ.get("FAULT_RANK", "1").split(",")]

if start == 0 and rank in fault_ranks:
    if fault == "stall":
        forward_backward = Trainer._forward_backward  # where every step starts, pipelined or not

        def stalled_step(self):
            if self.step == at:
                if rank == fault_ranks[0]:
                    Path(os.environ["FAULT_MARK"]).write_text(repr(time.time()))
                while True:
                    time.sleep(60)
            return forward_backward(self)

        Trainer._forward_backward = stalled_step
    elif fault == "kill_in_save":
        dcp_save = dcp.save

        def killed_save(state, checkpoint_id=None, **kw):
            out = dcp_save(state, checkpoint_id=checkpoint_id, **kw)
            if int(state["trainer"].state_dict()["step"]) == at:  # the Progress part
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        checkpoint.dcp.save = killed_save

sys.exit(main(sys.argv[1:]))
