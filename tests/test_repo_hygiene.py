"""The repository speaks of the product only, and its documents' links resolve.

* No word of how the project was made in a tracked text file or path (the words are in
  :data:`WORDS`, spelt in pieces so that this file passes its own test): numbered work periods,
  assistants, numbered device runs; no citation of documents that are not in the repository
  (design notes, seed texts, numbered cases): cite ``docs/design.md#...``, a test or a public
  report instead.
* No absolute path of a machine (:data:`PATHS`: the usual home, scratch and work roots).
* Every relative link in ``README.md`` and ``docs/*.md`` names a file that exists, and every
  ``#anchor`` a heading of its target (GitHub's anchor rule: lower case, punctuation dropped,
  spaces to hyphens).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: (what, pattern): words of the making of the project, and citations of documents outside it
_SESSION, _HELPER, _CALL = "sess" + "ion", "hel" + "per", "ca" + "ll"
_DOCS = "|".join(rf"\b{name}\.md\b" for name in ("DES" + "IGN", "CA" + "SES", "ST" + "YLE"))
WORDS = (
    ("a work period", re.compile(rf"\b{_SESSION}s?\b", re.I)),
    ("an assistant", re.compile(rf"\b{_HELPER}s?\b", re.I)),
    ("a numbered device run", re.compile(rf"\b{_CALL}s? \d+\b", re.I)),
    ("a document outside the repository", re.compile(_DOCS)),
    ("a numbered case", re.compile(r"\b" + "ca" + r"se-?\d\d\b", re.I)),
    ("a seed text", re.compile(r"\bseeds/|\bseed 0\d\d\b|\bseed §|\bthe seed's\b".replace("seed", "se" + "ed"), re.I)),
)

#: absolute paths of a machine: the work, home, root and Users roots, and named files in the scratch dir
_ROOTS = "|".join(("wo" + "rk", "ho" + "me", "ro" + "ot", "Us" + "ers"))
PATHS = re.compile(rf"(?<![\w.~-])/(?:{_ROOTS})/|(?<![\w.~-])/t" + r"mp/[A-Za-z0-9_]")

#: (path, word) pairs that are allowed: kept empty unless a word is the product's own term
ALLOWED: set[tuple[str, str]] = set()


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p]


def _text(path: str) -> str | None:
    """The file's text, or None for a binary file (a NUL byte in its first 8 KiB) or a missing one."""
    try:
        data = (ROOT / path).read_bytes()
    except FileNotFoundError:  # deleted in the work tree, not yet in the index
        return None
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def _hits(path: str, text: str) -> list[str]:
    hits = []
    for what, pattern in WORDS:
        for m in pattern.finditer(path + "\n" + text):
            if (path, m.group(0).lower()) in ALLOWED:
                continue
            line = (path + "\n" + text).count("\n", 0, m.start())
            hits.append(f"{path}:{line}: {what}: {m.group(0)!r}")
    for m in PATHS.finditer(text):
        hits.append(f"{path}:{text.count(chr(10), 0, m.start()) + 1}: an absolute machine path: {m.group(0)!r}")
    return hits


def test_the_patterns_catch_what_they_are_for():
    bad = (f"measured in {_SESSION} 22", f"a {_HELPER} ran it", f"{_CALL} 3 of the device", "see DES" + "IGN.md",
           "ca" + "se-03 fails", "se" + "eds/000_x", "at /wo" + "rk/main", "in /t" + "mp/tree_x", "/ho" + "me/me/x",
           "/Us" + "ers/me")
    for text in bad:
        assert _hits("x.py", text), text
    good = ("seed=0", "torch.manual_seed(3)", "docs/design.md#memory",
            "data.path=/data/train.bin", "a call to the kernel", "tempfile in a/tmp/b")
    for text in good:
        assert not _hits("x.py", text), text


def test_no_development_words_or_machine_paths_in_tracked_files():
    hits = []
    for path in _tracked():
        text = _text(path)
        if text is not None:
            hits += _hits(path, text)
    assert not hits, f"{len(hits)} hits:\n" + "\n".join(hits)


def _anchor(heading: str) -> str:
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", path.read_text(), re.M)}


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for m in LINK.finditer(doc.read_text()):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_anchor_rule_matches_github():
    assert _anchor("DeepSeek-V3 checkpoints: Hugging Face in and out") == \
        "deepseek-v3-checkpoints-hugging-face-in-and-out"
    assert _anchor("The live-row contract") == "the-live-row-contract"
    assert _anchor("Several processes: torchrun and the dispatchers") == \
        "several-processes-torchrun-and-the-dispatchers"


def test_readme_stays_a_front_page():
    """The README is what a newcomer reads first: at most 250 lines, and the two commands exactly as
    ``.ci/run`` runs the test one (details live in ``docs/``)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    test_cmd = 'pip install -e ".[test]" torch==2.13.0 && pytest -q'
    assert test_cmd in readme and test_cmd in (ROOT / ".ci" / "run").read_text()
    assert "pip install -e . torch==2.13.0 && dropless-train" in readme
