"""The configuration reference, generated from the schema itself: every key with its type,
default and the one-line comment beside its field (units included). ``diloco config --show``
(or ``--reference``) prints it as the Markdown table that docs/configuration.md carries (a test fails when
the two drift apart); ``diloco config --show CONFIG [KEY=VALUE ...]`` adds the value each key
takes in that config."""

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


def _rows(cls: type, values, prefix: str = "") -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, value in ``values``, meaning) for every field of ``cls``, nested ones flattened."""
    rows, comments, defaults = [], _comments(cls), cls()
    for item in dataclasses.fields(cls):
        default, value = getattr(defaults, item.name), getattr(values, item.name)
        if dataclasses.is_dataclass(default):
            rows.extend(_rows(type(default), value, f"{prefix}{item.name}."))
            continue
        type_name = item.type if isinstance(item.type, str) else getattr(item.type, "__name__", str(item.type))
        rows.append((f"{prefix}{item.name}", type_name, repr(default), repr(value), comments.get(item.name, "")))
    return rows


def reference_markdown(config: Config | None = None) -> str:
    """Every key as a Markdown row; with ``config``, a column of the values it sets (bold where not the default)."""
    if config is None:
        lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    else:
        lines = ["| key | type | default | this config | meaning |", "| --- | --- | --- | --- | --- |"]
    for key, type_name, default, value, meaning in _rows(Config, config or Config()):
        meaning = meaning.replace("|", "/")
        if config is None:
            lines.append(f"| `{key}` | {type_name} | `{default}` | {meaning} |")
        else:
            shown = f"`{value}`" if value == default else f"**`{value}`**"
            lines.append(f"| `{key}` | {type_name} | `{default}` | {shown} | {meaning} |")
    return "\n".join(lines) + "\n"
