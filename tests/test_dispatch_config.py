"""Configuration of the dispatchers and the mesh (single process).

* ``build_dispatcher``: every name builds its class; an unknown name is a ConfigError that
  lists the names; ``n_routed_experts`` not divisible by EP is a ConfigError.
* ``build_mesh``: a world size that ep_size does not divide, or an E that EP does not divide,
  is a ConfigError naming the field, raised before any process group exists; world 1 works
  without ``init_process_group`` (checked in a fresh interpreter, since it creates a group).
* With no EP group (EP = 1), ``a2a`` and ``agrs`` move nothing and the MoE layer equals
  ``local`` — output and every gradient — on one process, A ∈ {1, 8}.
* ``comm_stats`` reads and resets the byte counters.
Runtime ≈ 5 s.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from dropless.config import ConfigError, ModelArgs
from dropless.dispatch import DISPATCHERS, LocalDispatcher, build_dispatcher
from dropless.dispatch.a2a import A2ADispatcher
from dropless.dispatch.agrs import AGRSDispatcher
from dropless.dispatch.fsdp import FSDPDispatcher
from dropless.dispatch.mesh import build_mesh, check_ep_size
from dropless.moe import MoE
from tests.conftest import assert_scaled

ARGS = dict(hidden_size=16, moe_intermediate_size=8, aux_loss_alpha=0.0, seed=1)


def test_build_dispatcher_names():
    args = ModelArgs(**ARGS)
    assert DISPATCHERS == ("local", "a2a", "agrs", "fsdp", "deepep")
    for name, cls in (("local", LocalDispatcher), ("a2a", A2ADispatcher), ("agrs", AGRSDispatcher),
                      ("fsdp", FSDPDispatcher)):
        d = build_dispatcher(name, args)
        assert type(d) is cls and d.name == name and d.ep_size == 1 and d.num_local_experts == 8


def test_build_dispatcher_unknown_name_lists_the_known_ones():
    with pytest.raises(ConfigError) as ei:
        build_dispatcher("alltoall", ModelArgs(**ARGS))
    msg = str(ei.value)
    assert "alltoall" in msg and all(n in msg for n in DISPATCHERS)


def test_build_dispatcher_rejects_unknown_options():
    with pytest.raises(ConfigError, match="unknown options"):
        build_dispatcher("a2a", ModelArgs(**ARGS), capacity_factor=2)


@pytest.mark.parametrize("world,ep,e,field", [(4, 3, 8, "ep_size"), (6, 3, 8, "n_routed_experts"),
                                              (4, 0, 8, "ep_size")])
def test_mesh_shape_errors(world, ep, e, field):
    with pytest.raises(ConfigError, match=field):
        build_mesh(world, ep, "cpu", n_routed_experts=e)
    with pytest.raises(ConfigError, match=field):
        check_ep_size(world, ep, e)


def test_mesh_world_above_one_without_torchrun_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    with pytest.raises(ConfigError, match="torchrun"):
        build_mesh(2, 2, "cpu")


def test_mesh_world_one_without_init():
    code = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(v, None)
        from dropless.config import ModelArgs
        from dropless.dispatch import build_dispatcher
        from dropless.dispatch.mesh import build_mesh
        assert not dist.is_initialized()
        mesh = build_mesh(1, 1, "cpu", n_routed_experts=8)
        assert mesh.mesh_dim_names == ("dp", "ep") and tuple(mesh.shape) == (1, 1), mesh
        d = build_dispatcher("a2a", ModelArgs(), mesh)
        assert d.ep_size == 1 and d.num_local_experts == 8
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-2000:]


@pytest.mark.parametrize("name", ["a2a", "agrs"])
@pytest.mark.parametrize("a,fold", [(1, False), (8, True)])
def test_single_rank_ep_dispatchers_equal_local(name, a, fold):
    args = ModelArgs(**ARGS, expert_alignment=a, fold_routing_weights=fold)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(4))
    outs = []
    for disp in (LocalDispatcher(8), build_dispatcher(name, args)):
        moe = MoE(args, 1, disp)
        moe.init_weights()
        xx = x.clone().requires_grad_()
        y = moe(xx)
        (y * torch.cos(xx)).sum().backward()
        outs.append((y.detach(), xx.grad, moe.router.weight.grad, moe.experts.w13.grad, moe.experts.w2.grad))
    for got, want in zip(outs[1], outs[0]):
        assert_scaled(got, want, 1e-6)


def test_comm_stats_read_and_reset():
    d = build_dispatcher("a2a", ModelArgs(**ARGS))
    d.comm.add(10, 7)
    assert d.comm_stats(reset=False) == {"bytes_sent": 10, "bytes_received": 7}
    assert d.comm_stats() == {"bytes_sent": 10, "bytes_received": 7}
    assert d.comm_stats() == {"bytes_sent": 0, "bytes_received": 0}


def test_local_two_phase_api_is_eager():
    d = LocalDispatcher(8)
    x = torch.randn(4, 16)
    idx = torch.tensor([[0, 1], [2, 3], [7, 0], [5, 6]])
    w = torch.rand(4, 2)
    p = d.dispatch_async(x, idx, w, alignment=8)
    got = p.wait()
    want = d.dispatch(x, idx, w, alignment=8)
    assert torch.equal(got.layout.end, want.layout.end)
    y = d.combine_async(got.rows_MH, got.handle).wait()
    assert torch.allclose(y, d.combine(want.rows_MH, want.handle))


@pytest.mark.slow
def test_mesh_groups_carry_the_timeout():
    """build_mesh's dp and ep groups time out after ``timeout_s`` (not torch's 30 min); a dimension
    over every rank is the default group (started here with 20 s). The FSDP2 1-D world mesh
    (dropless/train/shard.py::world_mesh) is the default group, so it carries its timeout (on a CUDA
    build of torch ``init_device_mesh`` made a new group with the 30-minute default)."""
    from tests import dist_harness as H

    res = H.run_world("mesh_timeout_worker", 2, 5.0, pg_timeout_s=20.0, deadline_s=120)
    for r, out in enumerate(res):
        assert "error" not in out, out
        assert out[2]["shape"] == (1, 2) and out[2]["coord"] == [0, r], out
        assert out[2]["ep"] == out[2]["ep_sub"] == dict(world=True, ranks=[0, 1], timeout_s=20.0), out
        assert out[2]["dp"] == dict(world=False, ranks=[r], timeout_s=5.0), out
        assert out[1]["shape"] == (2, 1) and out[1]["coord"] == [r, 0], out
        assert out[1]["dp"] == dict(world=True, ranks=[0, 1], timeout_s=20.0), out
        assert out[1]["ep"] == out[1]["ep_sub"] == dict(world=False, ranks=[r], timeout_s=5.0), out
        assert out["fsdp_world"]["world"] and out["fsdp_world"]["timeout_s"] == 20.0, out
