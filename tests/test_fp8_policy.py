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
from dropless.ops.fp8_backend import Fp8Backend
from tests import dist_harness as H
from tests.conftest import assert_scaled

HUGE = 10**9  # rows per expert no layer reaches: that GEMM runs in bf16


def test_plan_follows_the_table_per_gemm():
    table = {"fc1": 100, "fc2": 200, "fc1_dgrad": 0, "fc2_dgrad": 300, "wgrad": 150}
    plan = fp.plan_fp8(150.0, table)
    assert plan == fp.Fp8Plan(fc1=True, fc2=False, fc1_dgrad=True, fc2_dgrad=False, wgrad=True)
    assert plan.bf16_gemms() == ["fc2", "fc2_dgrad"]
    assert fp.plan_fp8(149.9, table).bf16_gemms() == ["fc2", "fc2_dgrad", "wgrad"]
    assert fp.plan_fp8(300, table) == fp.ALL_FP8 and fp.plan_fp8(0.0) == fp.ALL_FP8  # unmeasured table: FP8
    assert fp.expected_rows_per_expert(8192, 8, 256, 8) == 2048.0
    assert fp.expected_rows_per_expert(4096, 8, 32) == 1024.0
    with pytest.raises(ValueError, match="fc2_dgrad"):
        fp.plan_fp8(10.0, {k: v for k, v in table.items() if k != "fc2_dgrad"})


def test_describe_names_the_layer_the_gemms_and_the_crossover():
    table = dict.fromkeys(fp.GEMMS, 0) | {"fc2_dgrad": 512}
    assert fp.describe(fp.ALL_FP8, "layer 3", 100.0, 7168, 2048, table) is None
    msg = fp.describe(fp.plan_fp8(100.0, table), "layer 3", 100.0, 7168, 2048, table)
    assert "layer 3" in msg and "fc2_dgrad (FP8 from 512 rows)" in msg and "fc1" not in msg.replace("fc1_", "")
    assert "100 expected rows per expert" in msg and "bf16" in msg


def _moe(dispatcher="local", layer_id=H.LAYER_ID, **over):
    args = H.model_args(moe_intermediate_size=16, expert_alignment=8, gemm="fp8", **over)
    m = MoE(args, layer_id, build_dispatcher(dispatcher, args, None))
    m.init_weights()
    m.experts.backend = Fp8Backend(emulate=True, fused_quant=True)
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

    def table(**rows):
        for g in fp.GEMMS:
            monkeypatch.setitem(fp.MIN_ROWS_PER_EXPERT, g, rows.get(g, 0))
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
