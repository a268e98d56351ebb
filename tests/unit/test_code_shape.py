"""The package's shape stays readable: no function over 60 lines, no class over 250 (a function's
lines from its ``def`` to its last line, docstring and comments included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "diloco"
LIMITS = {"function": 60, "class": 250}

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


def test_no_function_over_60_lines_and_no_class_over_250():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for kind, name, lines in _too_long(path.read_text()):
            if not _allowed(relative, name):
                offenders.append(f"diloco/{relative}::{name} ({kind}, {lines} lines)")
    assert not offenders, "over the limit: " + "; ".join(offenders)


def test_a_long_function_and_a_long_method_are_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMITS["function"]))
    source = f"def long():\n{body}\n\nclass Short:\n    def long(self):\n{body.replace('    ', '        ')}"
    over = LIMITS["function"] + 1
    assert _too_long(source) == [("function", "long", over), ("function", "Short.long", over)]


def test_a_function_at_the_limit_passes_and_a_long_class_is_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMITS["function"] - 1))
    assert _too_long(f"def at_the_limit():\n{body}") == []
    methods = "".join(f"    def m{i}(self):\n        pass\n" for i in range(LIMITS["class"] // 2))
    assert _too_long(f"class Long:\n{methods}") == [("class", "Long", LIMITS["class"] + 1)]
