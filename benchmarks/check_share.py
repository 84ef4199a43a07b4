"""Share of a package's code lines that are checks and messages (a size measure of the guard code).

Usage: ``python -m benchmarks.check_share [DIR ...]`` (default ``dropless/train``); prints one JSON
line per directory: ``code_lines``, ``check_lines``, ``share``.

Code lines: the non-blank lines of the ``.py`` files that are neither comments nor docstrings.
Check lines: the code lines that belong to

* a ``raise`` statement (all its lines);
* the condition of an ``if`` whose body is only raises and message calls (``if ...: raise``);
* a call of ``need(...)`` or of a ``warn(...)`` (``warnings.warn``, ``console.warn``) (all its lines);
* a message string inside a function: a string or f-string literal of at least 30 characters with
  a space in it, not a docstring (the text of errors, warnings and notes built in place).

Read from the source with :mod:`ast` and :mod:`tokenize`; nothing is imported or run.
"""

from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
from pathlib import Path

MESSAGE_CALLS = {"need", "warn"}


def _docstring_lines(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.update(range(body[0].lineno, body[0].end_lineno + 1))
    return out


def _code_lines(src: str, docstrings: set[int]) -> set[int]:
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                        tokenize.ENDMARKER):
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines - docstrings


def _span(node: ast.AST) -> range:
    return range(node.lineno, node.end_lineno + 1)


def _is_message_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    return name in MESSAGE_CALLS


def _literal_text(node: ast.AST) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return ""


def _check_lines(tree: ast.AST, docstrings: set[int]) -> set[int]:
    out: set[int] = set()
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) or _is_message_call(node):
            out.update(_span(node))
        elif isinstance(node, ast.If) and not node.orelse and all(
                isinstance(s, ast.Raise) or (isinstance(s, ast.Expr) and _is_message_call(s.value)) for s in node.body):
            out.update(_span(node.test))
    for fn in funcs:
        for node in ast.walk(fn):
            text = _literal_text(node)
            if len(text) >= 30 and " " in text and node.lineno not in docstrings:
                out.update(_span(node))
    return out


def measure(directory: Path) -> dict:
    code = checks = 0
    for path in sorted(directory.rglob("*.py")):
        src = path.read_text()
        tree = ast.parse(src)
        docstrings = _docstring_lines(tree)
        lines = _code_lines(src, docstrings)
        code += len(lines)
        checks += len(_check_lines(tree, docstrings) & lines)
    return {"dir": str(directory), "code_lines": code, "check_lines": checks, "share": round(checks / code, 4)}


def main(argv: list[str]) -> int:
    for d in argv or ["dropless/train"]:
        print(json.dumps(measure(Path(d))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
