"""README.md stays true: its commands exist; docs/configuration.md's reference is the schema's."""

from __future__ import annotations

from pathlib import Path

from diloco.cli import _parser
from diloco.config import load_config, masked
from diloco.config.reference import reference_markdown

README = Path(__file__).resolve().parents[2] / "README.md"
CONFIGURATION = README.parent / "docs" / "configuration.md"


def test_readme_configuration_reference_matches_the_schema():
    assert reference_markdown() in CONFIGURATION.read_text(), (
        "docs/configuration.md's table is out of date: paste the output of `diloco config --show`"
    )

    unexplained = [line for line in reference_markdown().splitlines()[2:] if line.endswith("|  |")]
    assert not unexplained, unexplained  # every key's meaning: a comment on its field's own line


def test_readme_quick_start_scripts_exist():
    text = README.read_text()
    for script in ("launch/demo.sh", "launch/test.sh"):
        assert f"bash {script}" in text
        assert (README.parent / script).is_file()


def test_every_documented_subcommand_exists():
    commands = _parser()._subparsers._group_actions[0].choices
    for name in commands:
        assert f"diloco {name}" in README.read_text(), f"README.md does not document `diloco {name}`"


def test_every_example_is_in_the_readme():
    for example in sorted([*(README.parent / "examples").glob("*.sh"), *(README.parent / "examples").glob("*.py")]):
        assert f"examples/{example.name}" in README.read_text(), f"README.md does not list {example.name}"


def test_config_show_marks_what_a_config_changes_and_masks_the_run_key():
    table = reference_markdown(masked(load_config(None, ["inner.lr=0.01", "comm.run_key=hunter2"])))
    assert "| `inner.lr` | float | `0.001` | **`0.01`** |" in table
    assert "| `inner.steps` | int | `500` | `500` |" in table
    assert "hunter2" not in table and "**`'<set>'`**" in table
