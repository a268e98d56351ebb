"""The import-linter contracts of pyproject.toml place every module of the package: a module that
no layer names (itself or a package above it) would be free to import anything, so a new one
fails here until it is given its layer. ``lint-imports`` checks the arrows between the layers."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "diloco"


def _layer_modules() -> set[str]:
    """Every module a layers contract names, containers' prefixes added."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    named = set()
    for contract in contracts:
        if contract["type"] != "layers":
            continue
        prefixes = [f"{container}." for container in contract.get("containers", [])] or [""]
        for layer in contract["layers"]:
            for name in re.split(r"[|:]", layer):
                named.update(prefix + name.strip().strip("()") for prefix in prefixes)
    return named


def _package_modules() -> list[str]:
    """Every module of the package by its import name (a package by its own), the package itself left out."""
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1:
            modules.append(".".join(parts))
    return modules


def _named(module: str, named: set[str]) -> bool:
    parts = module.split(".")
    return any(".".join(parts[:end]) in named for end in range(2, len(parts) + 1))


def test_every_module_of_the_package_is_in_a_layer():
    named = _layer_modules()
    modules = _package_modules()
    assert "diloco.worker.train" in modules and _named("diloco.worker.train", named)
    missing = [module for module in modules if not _named(module, named)]
    assert not missing, f"in no layer of pyproject.toml's import-linter contracts: {missing}"


def test_a_module_in_no_layer_is_found():
    assert not _named("diloco.newcomer", _layer_modules())
