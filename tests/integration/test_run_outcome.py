"""How a run ended, told by the real command line: a rerun whose workers all refuse the run
directory's checkpoint (another model) is that one error and exit 2, not the run before's summary,
over hivemind and in the simulator; ``diloco summary`` reads a finished run as ``diloco local``
printed it; ``diloco train`` writes ``summary.json`` at its end."""

from __future__ import annotations

import json

import pytest

from diloco.models.config import ModelConfig
from diloco.models.gpt import GPT
from diloco.worker.checkpoint import save_checkpoint
from tests.conftest import TINY
from tests.records import write_session

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SHORT = [*TINY, "inner.steps=10", "outer.sync_every=5"]


def _run_of_another_model(run_dir, workers: int) -> None:
    """A finished run of another model in ``run_dir``: its records and a checkpoint per worker."""
    other = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))  # TINY's n_embd is 64
    for worker in range(workers):
        write_session(run_dir, worker, val_loss=2.5)
        save_checkpoint(run_dir / "checkpoints", worker, 1, {"model": other.state_dict()})


@pytest.mark.parametrize("backend", ["hivemind", "simulator"])
def test_a_rerun_with_another_model_is_one_error_line_and_exit_2_and_its_summary_names_the_failed(
    tmp_path, diloco_cli, backend
):
    run_dir = tmp_path / "run"
    _run_of_another_model(run_dir, 2)
    done = diloco_cli("local", "--workers", "2", "--run-dir", str(run_dir), *SHORT, f"comm.backend={backend}")
    assert done.returncode == 2, done.stdout[-3000:]
    errors = [line for line in done.stdout.splitlines() if line.startswith("diloco: error:")]
    assert len(errors) == 1 and "is of another model" in errors[0], done.stdout[-3000:]
    assert "Traceback" not in done.stdout and "workers finished" not in done.stdout, done.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failed_workers"] == [0, 1] and summary["workers"] == 0, summary
    assert all("is of another model" in summary["errors"][str(w)] for w in (0, 1)), summary


def test_diloco_summary_reads_a_finished_run_as_diloco_local_printed_it(tmp_path, diloco_cli):
    run_dir = tmp_path / "run"
    done = diloco_cli("local", "--workers", "2", "--run-dir", str(run_dir), *SHORT, "comm.backend=simulator")
    assert done.returncode == 0, done.stdout[-3000:]
    read = diloco_cli("summary", str(run_dir))
    assert read.returncode == 0, read.stdout
    assert read.stdout.startswith("run run: 2 workers finished\ninner steps 10, rounds 2"), read.stdout
    assert read.stdout in done.stdout  # the very lines the launcher printed at its end


def test_diloco_train_writes_summary_json_at_its_end(tmp_path, diloco_cli):
    run_dir = tmp_path / "run"
    done = diloco_cli("train", *SHORT, f"run.dir={run_dir}")
    assert done.returncode == 0, done.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["workers"] == 1 and summary["rounds"] == 2 and summary["failed_workers"] == [], summary
    assert summary["params_agree"] and summary["per_worker"][0]["inner_steps"] == 10, summary
