"""The package's shape stays readable: no function over 80 lines, no class over 300 (a function's
lines from its ``def`` to its last line, docstring and comments included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "diloco"
LIMITS = {"function": 80, "class": 300}

# Over a limit on purpose, each with its reason (none at present)
ALLOWED: dict[str, set[str] | str] = {}


def _too_long(source: str) -> list[tuple[str, str, int]]:
    """(kind, qualified name, lines) of every function and class of ``source`` over its limit."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                lines = child.end_lineno - child.lineno + 1
                if lines > LIMITS[kind]:
                    found.append((kind, prefix + child.name, lines))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _allowed(path: str, name: str) -> bool:
    allowed = ALLOWED.get(path, set())
    return allowed == "*" or name in allowed


def test_no_function_over_80_lines_and_no_class_over_300():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for kind, name, lines in _too_long(path.read_text()):
            if not _allowed(relative, name):
                offenders.append(f"diloco/{relative}::{name} ({kind}, {lines} lines)")
    assert not offenders, "over the limit: " + "; ".join(offenders)


def test_a_long_function_and_a_long_method_are_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    source = f"def long():\n{body}\n\nclass Short:\n    def long(self):\n{body.replace('    ', '        ')}"
    assert _too_long(source) == [("function", "long", 81), ("function", "Short.long", 81)]
