"""benchmarks/fp8_fused.py end to end on the CPU (``--smoke``: tiny shapes, the emulated FP8 backend)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.fp8_fused import SWEEP_COMBINE_TILE, SWEEP_ROW_BLOCK, VARIANTS, main


def test_fp8_fused_benchmark_smoke_json_lines(capsys):
    assert main(["--smoke", "--only", "experts_rows,quant_kernels"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    rows = [r for r in lines if r["bench"] == "experts_rows"]
    assert [r["variant"] for r in rows] == list(VARIANTS)
    assert all(r["fwdbwd_ms"] > 0 and r["device"] == "cpu" for r in rows)
    assert "speedup" not in rows[0] and all(r["speedup"] > 0 for r in rows[1:])
    kern = [r for r in lines if r["bench"] == "quant_kernels"]
    ops = {(r["op"], r["group"], r["rows_live"]) for r in kern}
    assert ("scatter_quant_rows", 128, 96) in ops and ("combine_bwd_quant", 0, 512) in ops
    assert ("quant_rows_full_buffer", 0, 96) in ops and ("scatter_rows", None, 96) in ops
    assert ("combine_bwd_quant_k", 128, 96) in ops and ("combine_bwd_k_then_quant_rows", 0, 512) in ops
    assert ("combine_bwd_then_quant_rows", 0, 96) in ops and ("quant_token_blocks", 0, 96) in ops
    assert {r["impl"] for r in kern if r["group"] is not None} == {"new"}
    assert {r["k"] for r in kern if r["op"] == "combine_bwd"} == {1, 8}
    assert all(r["rows_alloc"] == 512 and r["us"] > 0 and r["gbps"] >= 0 for r in kern)
    assert lines[-1]["bench"] == "wall" and lines[-1]["seconds"] > 0


def test_fp8_fused_benchmark_times_another_revision_and_sweeps(capsys):
    """``--old DIR`` loads DIR's fp8_quant.py / fp8_fused_rows.py (here this checkout's own) and times them beside
    the current ones (``impl`` "old"); ``--sweep`` adds the launch variants."""
    import dropless.ops as ops_pkg

    assert main(["--smoke", "--only", "quant_kernels", "--old", os.path.dirname(ops_pkg.__file__), "--sweep"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    kern = [r for r in lines if r["bench"] == "quant_kernels" and r["group"] is not None]
    assert {r["impl"] for r in kern} == {"new", "old"}
    assert {(r["op"], r["group"], r["rows_live"]) for r in kern if r["impl"] == "old"} == \
        {(r["op"], r["group"], r["rows_live"]) for r in kern if r["impl"] == "new"}
    sweep = [r for r in lines if r["bench"] == "quant_sweep"]
    assert {tuple(r["row_block"]) for r in sweep if "row_block" in r} == set(SWEEP_ROW_BLOCK)
    assert {r["combine_tile"] for r in sweep if "combine_tile" in r} == set(SWEEP_COMBINE_TILE)


def test_crossover_times_each_gemm_with_its_row_kernel(capsys):
    """``crossover`` (smoke): a point per GEMM, size and quant, and one table line per GEMM and quant; in_kernel
    only for the GEMMs whose operand a row kernel makes (FC1, FC2, FC2's data gradient)."""
    from dropless.ops.fp8_policy import GEMMS

    assert main(["--smoke", "--only", "crossover"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    table = {(r["gemm"], r["quant"]): r for r in lines if r["bench"] == "crossover"}
    assert set(table) == {(g, "separate") for g in GEMMS} | {(g, "in_kernel") for g in ("fc1", "fc2", "fc2_dgrad")}
    assert all(r["k"] == 2 and r["sizes"] == [16, 64] for r in table.values())
    points = [r for r in lines if r["bench"] == "crossover_point"]
    assert len(points) == 2 * len(table) and all(r["bf16_us"] > 0 and r["fp8_us"] > 0 for r in points)


def test_crossover_routing_lands_each_token_on_k_live_rows():
    import torch

    from benchmarks.fp8_fused import _routing_onto
    from dropless.layout import ExpertLayout

    lay = ExpertLayout.from_counts(torch.tensor([5, 0, 7, 4]), 8, num_rows=16)
    src, dest = _routing_onto(lay, 3, torch.device("cpu"))
    live = lay.live_mask()
    assert dest.shape == (5, 3) and live[dest.flatten()].all() and dest.flatten().unique().numel() == 15
    assert torch.equal(src[dest], torch.arange(5).unsqueeze(1).expand(5, 3))
    assert int((src >= 0).sum()) == 15 and not (src[~live] >= 0).any()


def test_fp8_fused_benchmark_refuses_an_unknown_measurement():
    with pytest.raises(SystemExit) as e:
        main(["--smoke", "--only", "experts"])
    assert e.value.code == 2
