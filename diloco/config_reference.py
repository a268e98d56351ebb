"""The configuration reference, generated from the schema itself: every key with its type,
default and the one-line comment beside its field. ``diloco config --reference`` prints it as
the Markdown table that README.md carries (a test fails when the two drift apart)."""

from __future__ import annotations

import dataclasses
import inspect
import re

from diloco.config import Config

_FIELD_COMMENT = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+)$")


def _comments(cls: type) -> dict[str, str]:
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        if match := _FIELD_COMMENT.match(line):
            comments[match.group(1)] = match.group(2).strip()
    return comments


def _rows(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    rows, comments, defaults = [], _comments(cls), cls()
    for item in dataclasses.fields(cls):
        value = getattr(defaults, item.name)
        if dataclasses.is_dataclass(value):
            rows.extend(_rows(type(value), f"{prefix}{item.name}."))
            continue
        type_name = item.type if isinstance(item.type, str) else getattr(item.type, "__name__", str(item.type))
        rows.append((f"{prefix}{item.name}", type_name, repr(value), comments.get(item.name, "")))
    return rows


def reference_markdown() -> str:
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, type_name, default, meaning in _rows(Config):
        lines.append(f"| `{key}` | {type_name} | `{default}` | {meaning.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
