"""``dropless-train --help`` prints plain text (issue 11 item 16: it printed raw reST)."""

from __future__ import annotations

from dropless.train.__main__ import main


def test_help_is_plain_text(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "dropless-train [KEY=VALUE ...]" in out and "checks the config on its own" in out
    assert "Recipes:" in out and "h200_single" in out
    assert "``" not in out and "::" not in out and ":class:" not in out
