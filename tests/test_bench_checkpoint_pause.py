"""benchmarks/checkpoint_pause.py on CPU: every mode's record, its saves, and no run directory left."""

from __future__ import annotations

import json

import pytest

from benchmarks.checkpoint_pause import MODES, main, run_mode


def test_checkpoint_pause_benchmark_records_every_save(tmp_path, capsys):
    assert main(["--recipe", "cpu_default", "--warmup", "1", "--gap", "1", "--saves", "2", "--run-dir", str(tmp_path),
                 "--set", "train.micro_batch_size=2", "--set", "train.seq_len=32", "--set", "num_threads=1"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [r["mode"] for r in recs] == list(MODES)
    for r in recs:
        assert r["recipe"] == "cpu_default" and r["device"] == "cpu" and r["stager"] is None  # no pinning on CPU
        assert 0.001 < r["saved_gib"] < 0.1 and r["step_ms"] > 0
        assert [s["step"] for s in r["saves"]] == [2, 3]
        for s in r["saves"]:
            assert 0 <= s["waited_s"] <= s["paused_s"]
            assert (s["staged_s"] is None) == (r["mode"] == "sync")
            if s["staged_s"] is not None:
                assert 0 < s["staged_s"] <= s["paused_s"]
        assert r["final_wait_s"] >= 0 and (r["mode"] != "sync" or r["final_wait_s"] < 0.01)
    assert list(tmp_path.iterdir()) == []  # each mode's run directory (two checkpoints) is deleted


def test_unknown_mode_is_refused_before_any_build():
    with pytest.raises(ValueError, match="unknown mode 'fast'; one of sync, async, async_pageable"):
        run_mode("cpu_default", "fast", [], 0, 1, 1)
