"""Where FP8 pays (dropless/ops/fp8_policy.py): per GEMM of a layer's experts, FP8 or bf16 from the crossover table,
applied by the fused FP8 path and said once at the layer's first forward.

FP8 is emulated on CPU (``Fp8Backend(emulate=True, fused_quant=True)``, fp32 model): a GEMM the plan keeps in bf16 runs
through the ``torch`` backend, so with every GEMM in bf16 the layer equals ``gemm=torch`` up to fp32
summation order (1e-5 of the largest value; the SwiGLU backward is the fused kernel's formula there,
autograd's in ``gemm=torch``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dropless import moe as moe_mod
from dropless import permute
from dropless.dispatch import build_dispatcher
from dropless.moe import MoE
from dropless.ops import fp8_policy as fp
from dropless.ops.deep_gemm_backend import DeepGemmBackend
from dropless.ops.fp8_backend import Fp8Backend
from tests import dist_harness as H
from tests import fake_deep_gemm
from tests.conftest import assert_scaled

HUGE = 10**9  # rows per expert no layer reaches: that GEMM runs in bf16


def test_plan_follows_the_table_per_gemm():
    table = {"fc1": 100, "fc2": 200, "fc1_dgrad": 0, "fc2_dgrad": 300, "wgrad": 150}
    plan = fp.plan_fp8(150.0, table)
    assert plan == fp.Fp8Plan(fc1=True, fc2=False, fc1_dgrad=True, fc2_dgrad=False, wgrad=True)
    assert plan.bf16_gemms() == ["fc2", "fc2_dgrad"]
    assert fp.plan_fp8(149.9, table).bf16_gemms() == ["fc2", "fc2_dgrad", "wgrad"]
    assert fp.plan_fp8(300, table) == fp.ALL_FP8
    assert fp.plan_fp8(10**9, table | {"fc2": None}).bf16_gemms() == ["fc2"]  # None: never FP8
    assert fp.expected_rows_per_expert(8192, 8, 256, 8) == 2048.0
    assert fp.expected_rows_per_expert(4096, 8, 32) == 1024.0
    with pytest.raises(ValueError, match="fc2_dgrad"):
        fp.plan_fp8(10.0, {k: v for k, v in table.items() if k != "fc2_dgrad"})


def test_quant_of_each_path():
    """The recompute nodes quantise every operand in a pass of its own; the fused node FC2's in the SwiGLU,
    FC1's in the landing gather (fused_quant) or before an FP8 dispatch, FC2's data gradient's in the
    combine's backward (fused_quant)."""
    assert fp.quant_of(False, True, True) == dict.fromkeys(fp.GEMMS, "separate")
    assert fp.quant_of(True, False, False) == dict(fc1="separate", fc2="in_kernel", fc2_dgrad="separate",
                                                   fc1_dgrad="separate", wgrad="separate")
    assert fp.quant_of(True, False, True)["fc1"] == "in_kernel"
    assert fp.quant_of(True, True, False) == dict(fc1="in_kernel", fc2="in_kernel", fc2_dgrad="in_kernel",
                                                  fc1_dgrad="separate", wgrad="separate")


def test_crossover_table_takes_the_nearest_measured_shape_and_each_gemms_quant():
    cross = {(1024, 512, 64): {"separate": dict(fc1=None, fc2=None, fc2_dgrad=None, fc1_dgrad=None, wgrad=None),
                               "in_kernel": dict(fc1=64, fc2=64, fc2_dgrad=64)},
             (7168, 2048, 4): {"separate": dict(fc1=1024, fc2=2048, fc2_dgrad=4096, fc1_dgrad=512, wgrad=None),
                               "in_kernel": dict(fc1=512, fc2=512, fc2_dgrad=512)}}
    q = fp.quant_of(True, False, False)
    table, at = fp.crossover_table(1024, 512, 64, q, cross)
    assert at == (1024, 512, 64) and table == dict(fc1=None, fc2=64, fc2_dgrad=None, fc1_dgrad=None, wgrad=None)
    table, at = fp.crossover_table(7168, 2048, 8, fp.quant_of(True, True, False), cross)  # DeepSeek-V3 at EP 32
    assert at == (7168, 2048, 4) and table == dict(fc1=512, fc2=512, fc2_dgrad=512, fc1_dgrad=512, wgrad=None)
    assert fp.crossover_table(1280, 640, 48, q, cross)[1] == (1024, 512, 64)
    # the shipped table: h200_single's experts (H 1024, I 512, 64 experts, 3,072 rows each) on the fused path,
    # its codes written by the landing kernel and the combine's backward (fused_quant) or not
    table, at = fp.crossover_table(1024, 512, 64, fp.quant_of(True, True, False))
    assert at == (1024, 512, 64) and fp.plan_fp8(3072, table).bf16_gemms() == ["fc2", "fc1_dgrad", "fc2_dgrad",
                                                                                "wgrad"]
    assert fp.plan_fp8(3072, fp.crossover_table(1024, 512, 64, q)[0]).bf16_gemms() == list(fp.GEMMS)
    with pytest.raises(ValueError, match="quant"):
        fp.crossover_table(1024, 512, 64, dict(q, fc1="fused"), cross)


def test_describe_names_the_layer_the_gemms_and_the_crossover():
    table = dict.fromkeys(fp.GEMMS, 0) | {"fc2_dgrad": 512, "fc1_dgrad": None}
    assert fp.describe(fp.ALL_FP8, "layer 3", 100.0, 7168, 2048, table) is None
    msg = fp.describe(fp.plan_fp8(100.0, table), "layer 3", 100.0, 7168, 2048, table, (7168, 2048, 4))
    assert "layer 3" in msg and "fc2_dgrad (FP8 from 512 rows)" in msg and "fc1 " not in msg
    assert "fc1_dgrad (never faster in FP8)" in msg and "H 7168, I 2048, 4 experts" in msg
    assert "100 expected rows per expert" in msg and "bf16" in msg


def _moe(dispatcher="local", layer_id=H.LAYER_ID, plan_gemms=True, **over):
    args = H.model_args(moe_intermediate_size=16, expert_alignment=8, gemm="fp8", **over)
    m = MoE(args, layer_id, build_dispatcher(dispatcher, args, None))
    m.init_weights()
    m.experts.backend = Fp8Backend(emulate=True, fused_quant=True, plan_gemms=plan_gemms)
    return m


def _run(m):
    x, cot = H.global_batch(1, m.args)
    x = x.clone().requires_grad_()
    y = m(x)
    (y * cot).sum().backward()
    return [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters() if p.grad is not None]


@pytest.fixture
def fresh(monkeypatch):
    """No plan said yet in this process; returns a setter for the crossover table."""
    monkeypatch.setattr(moe_mod, "_FP8_PLANS_SAID", set())

    def table(**rows):  # one measured shape, the same entries whatever the quantisation
        entries = {g: rows.get(g, 0) for g in fp.GEMMS}
        monkeypatch.setattr(fp, "CROSSOVERS", {(16, 16, 8): {"separate": entries, "in_kernel": entries}})
    table()
    return table


def test_every_gemm_in_bf16_equals_gemm_torch_and_is_said_once(fresh):
    fresh(**dict.fromkeys(fp.GEMMS, HUGE))
    said = rf"layer {H.LAYER_ID} .*fc1 .*fc2 .*fc1_dgrad .*fc2_dgrad .*run in bf16"
    with pytest.warns(UserWarning, match=said) as rec:
        got = _run(_moe())
    assert len(rec) == 1 and "wgrad" not in str(rec[0].message)  # the weight gradient is bf16 anyway
    ref = MoE(H.model_args(moe_intermediate_size=16, expert_alignment=8, gemm="torch"), H.LAYER_ID)
    ref.init_weights()
    want = _run(ref)
    assert len(got) == len(want) >= 6
    for i, (a, b) in enumerate(zip(got, want)):
        assert_scaled(a, b.double(), 1e-5, f"value {i}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: not at the next call, nor for another layer of this shape
        _run(_moe(layer_id=H.LAYER_ID + 1))


def test_one_gemm_in_bf16_changes_only_what_it_computes(fresh, monkeypatch):
    """FC2's data gradient in bf16: the forward is the all-FP8 forward bit for bit, the combine's backward
    quantises nothing, and the gradients differ from all-FP8 by FP8 rounding only."""
    fused = {"n": 0}
    real_cbq = permute.combine_bwd_quant

    def counting(*a, **k):
        fused["n"] += 1
        return real_cbq(*a, **k)

    monkeypatch.setattr(permute, "combine_bwd_quant", counting)
    all_fp8 = _run(_moe())
    assert fused["n"] == 1
    fresh(fc2_dgrad=HUGE)
    fused["n"] = 0
    with pytest.warns(UserWarning, match="fc2_dgrad"):
        m = _moe()
        got = _run(m)
    assert fused["n"] == 0 and m.experts.path.plan.bf16_gemms() == ["fc2_dgrad"]
    assert torch.equal(got[0], all_fp8[0])
    assert not torch.equal(got[1], all_fp8[1])
    assert_scaled(got[1], all_fp8[1].double(), 0.1, "dx")


@pytest.mark.parametrize("dispatcher", ["local", "a2a"])
def test_fc1_in_bf16_lands_rows_not_codes(fresh, dispatcher):
    """FC1 in bf16 needs the rows: after the plan is made, no dispatcher lands FP8 codes (local's gather and
    a2a's dispatch move rows), and FC1's output is the bf16 GEMM's."""
    fresh(fc1=HUGE)
    m = _moe(dispatcher)
    assert m._row_quantiser(torch.float32) is not None  # before the first forward: no plan yet
    with pytest.warns(UserWarning, match="fc1 "):
        _run(m)
    assert m._row_quantiser(torch.float32) is None and not m.experts.takes_fp8_rows


def test_no_tokens_decides_nothing(fresh):
    fresh(fc1=HUGE)
    m = _moe()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(torch.zeros(0, m.args.hidden_size))
    assert m._fp8_plan is None


@pytest.mark.parametrize("over", [dict(recompute_gather=True), dict(recompute_fc1=True, recompute_gather=True)],
                         ids=["fused-node-gathers", "recompute-nodes"])
def test_recompute_options_run_each_gemm_where_the_plan_says(fresh, over):
    """gemm=fp8 with recompute_gather (the fused node, landing the rows itself) or recompute_fc1 (the recompute
    nodes): every GEMM in bf16 equals gemm=torch with the same options; one GEMM in bf16 runs on the backend's
    bf16 twin and the others on the FP8 backend."""
    fresh(**dict.fromkeys(fp.GEMMS, HUGE))
    with pytest.warns(UserWarning, match=r"fc1 .*fc2 .*fc1_dgrad .*fc2_dgrad .*run in bf16"):
        got = _run(_moe(**over))
    ref = MoE(H.model_args(moe_intermediate_size=16, expert_alignment=8, gemm="torch", **over), H.LAYER_ID)
    ref.init_weights()
    want = _run(ref)
    assert len(got) == len(want) >= 6
    for i, (a, b) in enumerate(zip(got, want)):
        assert_scaled(a, b.double(), 1e-5, f"value {i}")
    fresh(fc1_dgrad=HUGE)
    m = _moe(**over)
    with pytest.warns(UserWarning, match="fc1_dgrad"):
        _run(m)
    be, path = m.experts.backend, m.experts.path
    if over.get("recompute_fc1"):
        gemms = path.gemms
        assert gemms.fc1_dgrad is be.bf16 and gemms.fc1 is be and gemms.fc2 is be and gemms.fc2_dgrad is be
    else:
        assert path.plan.bf16_gemms() == ["fc1_dgrad"] and path.gathers


def test_without_plan_gemms_every_gemm_is_fp8(fresh):
    """plan_gemms False (and the emulated backend's default): no plan, nothing said, every GEMM in FP8."""
    assert not Fp8Backend(emulate=True).plan_gemms and Fp8Backend().plan_gemms
    # the table is measured for gemm=fp8's GEMM: DeepGEMM's backend leaves the plan off unless asked
    assert not DeepGemmBackend(module=fake_deep_gemm, emulate=True).plan_gemms
    assert DeepGemmBackend(module=fake_deep_gemm, emulate=True, plan_gemms=True).plan_gemms
    fresh(**dict.fromkeys(fp.GEMMS, HUGE))
    m = _moe(plan_gemms=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(m)
    assert m.experts.path.plan == fp.ALL_FP8
