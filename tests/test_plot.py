"""benchmarks/plot.py: a clear error without matplotlib, and the lines it draws are the newest of
their measurement in benchmarks/results/ (what the README's table quotes)."""

import sys

import pytest

from benchmarks import plot


def test_missing_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit, match=r"pip install -e \"\.\[plot\]\""):
        plot.main(["--out", "unused"])


def test_newest_picks_the_latest_date_then_the_last_line():
    lines = [{"date": "2026-12-02", "v": 1, "x": "a"}, {"date": "2026-12-03", "v": 2, "x": "a"},
             {"date": "2026-12-03", "v": 3, "x": "a"}, {"date": "2026-12-04", "v": 4, "x": "b"}]
    assert plot.newest(lines, "t", x="a")["v"] == 3
    with pytest.raises(SystemExit, match="no line of t"):
        plot.newest(lines, "t", x="c")


def test_the_training_step_drawn_is_the_one_the_readme_quotes():
    ours = plot.newest(plot.read("train_step.jsonl"), "train_step", gpu="H200", variant="eager+graph")
    peer = plot.newest(plot.read("peers.jsonl"), "peers", bench="train_step")
    assert (ours["date"], ours["commit"], round(ours["tokens_per_s"] / 1e3, 1)) == ("2026-12-04", "e8d7049", 140.9)
    assert (peer["tokens_per_s"], peer["peak_mem_gib"]) == (79200, 122)
