"""benchmarks/train_step.py on CPU: 3 timed steps of the tiny model give every JSON field."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks.train_step import CATEGORIES, category, counted_device_time_us, idle_gaps, main
from dropless.train.config import compose


def test_train_step_benchmark_json_fields(capsys):
    assert main(["--recipe", "cpu_default", "--variants", "eager", "--warmup", "1", "--steps", "3",
                 "--profile-steps", "1", "--set", "model=tiny", "--set", "train.micro_batch_size=2",
                 "--set", "train.seq_len=32", "--set", "num_threads=1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(lines) == 1
    r = lines[0]
    assert r["variant"] == "eager" and r["recipe"] == "cpu_default" and r["device"] == "cpu"
    assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["tflops"] > 0 and r["step_ms"] > 0
    assert r["peak_mem_gib"] > 0.05 and len(r["losses"]) == 4 and all(4 < x < 7 for x in r["losses"])
    assert r["tokens_per_s"] == pytest.approx(2 * 32 / (r["step_ms"] / 1e3), rel=1e-6)
    args = compose(["recipe=cpu_default", "model=tiny"]).model
    assert 1.0 <= r["expert_load_max_over_mean"] <= args.n_routed_experts / args.num_experts_per_tok
    k = r["kernel_ms_per_step"]
    assert set(k) == set(CATEGORIES) and all(v >= 0 for v in k.values())
    assert k["dense_gemm"] > 0 and k["grouped_gemm"] > 0 and k["optimizer"] > 0 and k["softmax_ce"] > 0
    assert r["kernel_ms_total_per_step"] == pytest.approx(sum(k.values()), abs=0.01) and r["kernels_per_step"] > 100


def test_fp8_gemms_forces_the_plan_of_every_moe_layer(monkeypatch):
    """--fp8-gemms: every MoE layer plans exactly the named GEMMs in FP8, whatever the table; a name that is no
    GEMM stops the run before any build."""
    from benchmarks.train_step import force_fp8_plan
    from dropless import moe
    from dropless.ops import fp8_policy as fp

    monkeypatch.setattr(moe, "plan_fp8", moe.plan_fp8)  # restored after the test
    force_fp8_plan("fc1,fc2_dgrad")
    plan = moe.plan_fp8(10.0, dict.fromkeys(fp.GEMMS, None))  # the table says bf16 for every GEMM
    assert plan.bf16_gemms() == ["fc2", "fc1_dgrad", "wgrad"]
    force_fp8_plan("none")
    assert moe.plan_fp8(1e9, dict.fromkeys(fp.GEMMS, 0)).bf16_gemms() == list(fp.GEMMS)
    with pytest.raises(SystemExit, match="fc3"):
        force_fp8_plan("fc1,fc3")


def test_variant_names_are_checked_before_any_build():
    from benchmarks.train_step import run_variant
    for bad in ("eager+fast", "graph", "compile_moe+graph+graph"):
        with pytest.raises(ValueError, match="optionally with '\\+graph'"):
            run_variant("cpu_default", bad, [], 0, 0, 0)


def test_kernel_categories():
    assert category("void cutlass::Kernel2<cutlass_sm90_grouped_gemm>") == "grouped_gemm"
    assert category("aten::_grouped_mm") == "grouped_gemm"
    assert category("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT") == "dense_gemm"
    assert category("void at::native::bfloat16_copy_kernel_cuda") == "casts_copies"
    assert category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>") \
        == "optimizer"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention"  # not "gmm"
    assert category("void at::native::cunn_SoftMaxForward") == "softmax_ce"
    assert category("void at::native::sbtopk::gatherTopK") == "sort_index_topk"
    assert category("_swiglu_kernel") == "other"
    assert category("triton_poi_fused_mul_silu_0") == "other"  # inductor's kernels are not the optimizer
    assert category("aten::_fused_adamw_") == "optimizer"


def test_gpu_user_annotations_are_not_counted():
    """torch.optim's ``Optimizer.step#AdamW.step`` range reaches the GPU as a user annotation spanning
    the optimizer's kernels; counting it would count them twice."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    kernel = SimpleNamespace(device_type=cuda, is_user_annotation=False, self_device_time_total=15_300.0)
    annotation = SimpleNamespace(device_type=cuda, is_user_annotation=True, self_device_time_total=15_700.0)
    host = SimpleNamespace(device_type=cpu, is_user_annotation=False, self_device_time_total=0.0)
    old_torch = SimpleNamespace(device_type=cuda, self_device_time_total=None, self_cuda_time_total=7.0)
    assert counted_device_time_us(kernel) == 15_300.0 and counted_device_time_us(annotation) == 0.0
    assert counted_device_time_us(host) == 0.0 and counted_device_time_us(old_torch) == 7.0


def test_copy_listing_names_ops_shapes_and_dropless_origins(tmp_path):
    """--copies: one profiled step's copy-like ops, each with shapes, dtypes and the dropless function
    (or backward node) that issued it; the hooks' bf16 -> fp32 main-gradient copies are there, one
    ``_foreach_copy_`` per trainable parameter whose gradient autograd delivers (its first gradient of the
    step; the profiler records a tensor list's shapes and dtypes only as ``TensorList``), which is every one
    but the experts' w13 and w2: their GradSink writes the fp32 main gradient in the wgrad kernel itself;
    the optimizer's large adds run on fp32 state."""
    from dropless.experts import GroupedExperts
    from dropless.train.config import compose
    from dropless.train.trainer import Trainer

    ov = ["model=tiny", "train.dtype=bf16", "train.micro_batch_size=2", "train.seq_len=32", "num_threads=1"]
    out = tmp_path / "copies.txt"
    assert main(["--recipe", "cpu_default", "--variants", "eager", "--warmup", "1", "--steps", "1",
                 "--profile-steps", "0", "--copies", str(out), *[a for o in ov for a in ("--set", o)]]) == 0
    text = out.read_text()
    assert text.startswith("copy-like operators of one training step: recipe=cpu_default variant=eager")
    hook = [ln for ln in text.splitlines() if "dropless/train/grads.py" in ln and "_hook" in ln]
    assert len(hook) == 1 and "aten::_foreach_copy_" in hook[0], hook
    tr = Trainer(compose(["recipe=cpu_default", f"run_dir={tmp_path}/run", "logging.mode=disabled", *ov]))
    n_params = sum(p.requires_grad for p in tr.model.parameters())
    n_sunk = sum(p.requires_grad for m in tr.model.modules() if isinstance(m, GroupedExperts)
                 for p in (m.w13, m.w2))
    tr.close()
    assert n_sunk >= 2 and int(hook[0].split()[0]) == n_params - n_sunk > 10
    adds = [ln for ln in text.splitlines() if "aten::add_" in ln and "clipped_step" in ln]
    assert adds and all("'float'" in ln for ln in adds)                      # the optimizer on fp32 state
    assert any("backward " in ln and "(of dropless/" in ln for ln in text.splitlines())


def test_idle_gaps_charge_each_gap_to_the_phase_and_operator_that_launched_its_end():
    """A synthetic Kineto trace of one step: kernels k1 [0, 10), k2 [30, 40), k3 [40.5, 50), k4 [80, 90) µs.
    k2 was launched at 25 (after k1 ended: host-bound, 20 µs) from aten::mm inside aten::linear during
    dropless.forward; k3's 0.5 µs gap is under the threshold (counted busy); k4 was launched at 45 (before k3
    ended: the device's own latency, 30 µs) by the backward thread's aten::add_ during dropless.backward."""
    def x(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    trace = {"traceEvents": [
        x("user_annotation", "dropless.forward", 0, 42), x("user_annotation", "dropless.backward", 42, 68),
        x("user_annotation", "unrelated", 0, 200),
        x("cpu_op", "aten::linear", 20, 10, **{"External id": 1}), x("cpu_op", "aten::mm", 22, 5, **{"External id": 2}),
        x("cpu_op", "autograd::engine::evaluate_function: AddBackward0", 43, 10, tid=2, **{"External id": 3}),
        x("cpu_op", "aten::add_", 44, 3, tid=2, **{"External id": 4}),
        x("cuda_runtime", "cudaLaunchKernel", -5, 1, correlation=10), x("kernel", "k1", 0, 10, tid=7, correlation=10),
        x("cuda_runtime", "cudaLaunchKernel", 25, 1, correlation=11),
        x("kernel", "k2", 30, 10, tid=7, correlation=11, **{"External id": 2}),
        x("cuda_runtime", "cudaLaunchKernel", 35, 1, correlation=12),
        x("kernel", "k3", 40.5, 9.5, tid=7, correlation=12),
        x("cuda_runtime", "cudaLaunchKernel", 45, 1, tid=2, correlation=13),
        x("kernel", "k4", 80, 10, tid=7, correlation=13, **{"External id": 4}),
    ]}
    r = idle_gaps(trace, steps=1)
    assert r["gpu_idle_ms_per_step"] == pytest.approx(0.050) and r["gpu_busy_ms_per_step"] == pytest.approx(0.040)
    assert r["idle_host_bound_ms_per_step"] == pytest.approx(0.020) and r["idle_gaps_per_step"] == 2
    assert r["idle_by_phase"] == {"dropless.backward": pytest.approx(0.030), "dropless.forward": pytest.approx(0.020)}
    assert r["idle_top"] == [[0.03, 1, "dropless.backward", "autograd::engine::evaluate_function: AddBackward0",
                              "aten::add_"], [0.02, 1, "dropless.forward", "aten::linear", "aten::mm"]]
    assert idle_gaps({"traceEvents": []}, steps=2)["gpu_idle_ms_per_step"] == 0.0
    half = idle_gaps(trace, steps=2)
    assert half["gpu_idle_ms_per_step"] == pytest.approx(0.025) and half["idle_top"][0][1] == 0.5
