"""The host staging of :mod:`dropless.dispatch.collectives` (the path for a gloo that refuses CUDA tensors).

On CPU ranks, with CPU tensors standing in for CUDA ones (``tests/gpu_rank_workers.staging_cpu_worker``):
the a2a layer with every collective staged through host copies, and agrs where the all-gather is
refused once when issued (as ``ProcessGroupGloo`` refuses a device it does not take) and the wrapper
stages it from then on, with a warning naming it. Both equal one rank's ``local`` on the global batch
(fp32, ‖got − ref‖ ≤ 1e-5·‖ref‖: outputs, ``dx`` and every gradient). The same on CUDA tensors runs in
``tests/test_gpu_ranks.py`` (``*-hoststaged``).
"""

from __future__ import annotations

import pytest

from tests import dist_harness as H
from tests.test_gpu_ranks import _rel

pytestmark = pytest.mark.slow


def test_staged_and_refused_collectives_give_the_local_values():
    world = 2
    res = H.run_world("tests.gpu_rank_workers:staging_cpu_worker", world, deadline_s=240)
    for name in ("a2a", "agrs"):
        ref = res[0][name]["ref"]
        for r in range(world):
            got = res[r][name]
            t = slice(r * 2, (r + 1) * 2)
            for key, want in (("y", ref["y"][t]), ("x_grad", ref["x_grad"][t]), ("router_grad", ref["router_grad"]),
                              ("w13_grad", ref["w13_grad"]), ("w2_grad", ref["w2_grad"])):
                assert _rel(got[key], want) <= 1e-5, (name, r, key, _rel(got[key], want))
    for r in range(world):
        assert res[r]["a2a"]["host_staged"] == ["a2a", "ag", "rs"]
        assert res[r]["agrs"]["host_staged"] == ["ag"]           # only the refused kind
        assert len(res[r]["agrs"]["warnings"]) == 1 and "token all-gather" in res[r]["agrs"]["warnings"][0]
