"""benchmarks/stamp.py adds date, commit, gpu and torch to each JSON line and keeps the rest."""

import io
import json

from benchmarks import stamp


def test_stamp_puts_the_fields_first_and_keeps_other_lines():
    src = io.StringIO('{"bench": "x", "ms": 1.5}\nnot json\n{"bench": "y", "gpu": "H100"}\n[1, 2]\n')
    out = io.StringIO()
    fields = {"date": "2026-12-07", "commit": "abc1234", "gpu": "H200", "torch": "2.11"}
    assert stamp.stamp(src, out, fields) == 2
    lines = out.getvalue().splitlines()
    first = json.loads(lines[0])
    assert list(first) == ["date", "commit", "gpu", "torch", "bench", "ms"]
    assert first["ms"] == 1.5 and first["commit"] == "abc1234"
    assert lines[1] == "not json" and lines[3] == "[1, 2]"
    assert json.loads(lines[2])["gpu"] == "H100"  # a field the line has is kept


def test_commit_is_this_checkout():
    c = stamp.detect_commit()
    assert c is None or len(c.split("+")[0]) >= 7
