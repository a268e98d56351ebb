"""README.md stays true: its configuration reference is the schema's, and its commands exist."""

from __future__ import annotations

from pathlib import Path

from diloco.cli import _parser
from diloco.config_reference import reference_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_configuration_reference_matches_the_schema():
    assert reference_markdown() in README.read_text(), (
        "README.md's configuration table is out of date: paste the output of `diloco config --reference`"
    )


def test_readme_quick_start_scripts_exist():
    text = README.read_text()
    for script in ("launch/demo.sh", "launch/test.sh"):
        assert f"bash {script}" in text
        assert (README.parent / script).is_file()


def test_every_documented_subcommand_exists():
    commands = _parser()._subparsers._group_actions[0].choices
    for name in ("train", "local", "bootstrap", "config", "plot", "bench"):
        assert name in commands and f"diloco {name}" in README.read_text()
