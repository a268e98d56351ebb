"""``diloco summary RUN_DIR``: a run at a glance from its records, live or finished, and one line
for a directory that holds no run."""

from __future__ import annotations

import pytest

from diloco.cli import main
from diloco.worker.metrics import format_summary, mark_start, summarize_run, write_summary
from tests.records import mark_start_of_a_gone_process, write_session

pytestmark = pytest.mark.usefixtures("cli_signal_handlers")  # main() sets its own


@pytest.mark.parametrize("where", ["missing", "empty", "no records"])
def test_a_directory_that_holds_no_run_is_one_error_line(tmp_path, capsys, where):
    run_dir = tmp_path / "run"
    if where != "missing":
        run_dir.mkdir()
    if where == "no records":
        (run_dir / "config.yaml").write_text("run: {}\n")
    assert main(["summary", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("diloco: error: ") and str(run_dir) in err, err


def test_a_finished_run_reads_as_the_summary_its_launcher_printed(tmp_path, capsys):
    for worker in (0, 1):
        write_session(tmp_path, worker)
    assert main(["summary", str(tmp_path)]) == 0
    assert capsys.readouterr().out == format_summary(summarize_run(tmp_path)) + "\n"


def test_a_live_run_shows_each_workers_state_step_round_and_losses(tmp_path, capsys):
    write_session(tmp_path, 0, rounds=2)
    write_session(tmp_path, 1, finished=False)  # by this process, alive: running
    assert main(["summary", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"run {tmp_path.name}: running, 1 of 2 workers finished",
        "  worker 0: finished  step     20  round    2  loss 3.0000  val loss 2.0000",
        "  worker 1: running   step     10  round    1  loss 3.0000  val loss 2.0000",
    ]


def test_a_failed_worker_reads_with_the_error_its_launcher_saw_this_run_only(tmp_path, capsys):
    write_session(tmp_path, 0)
    mark_start(tmp_path, 1)
    write_summary(tmp_path, ended=True, errors={1: "failed (exit code 2): another model"})
    assert main(["summary", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "worker 1 failed (exit code 2): another model"

    mark_start_of_a_gone_process(tmp_path, 1)  # a later launch, killed before its summary: the old error
    # in summary.json is not this launch's
    assert main(["summary", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "worker 1 failed: it ended without an end record"


def test_scripts_that_finished_without_records_read_as_their_launcher_saw_them(tmp_path, capsys):
    for worker in (0, 1):
        mark_start(tmp_path, worker)  # diloco launch: scripts of the user's that keep no records
    write_summary(tmp_path, ended=True, exited={0, 1})
    assert main(["summary", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"run {tmp_path.name}: 2 workers finished"

    for worker in (0, 1):
        mark_start_of_a_gone_process(tmp_path, worker)  # a later launch, killed before its summary
    assert main(["summary", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"run {tmp_path.name}: 0 workers finished, failed: [0, 1]"
