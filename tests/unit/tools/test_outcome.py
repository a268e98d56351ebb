"""How a ``diloco local`` run ended: each failed worker's one line, from its log or its exception,
and the exit code, from summaries of real records (written as workers write them)."""

from __future__ import annotations

import io

import pytest

from diloco.errors import ConfigError
from diloco.tools.outcome import Failure, failure_of_exception, failure_of_process, report
from diloco.worker.faults import StopRequested
from diloco.worker.metrics import mark_start, summarize_run
from tests.records import write_session


def _report(run_dir, failures: dict[int, Failure], **kwargs) -> tuple[int, str, str]:
    errors = {i: failure.describe() for i, failure in failures.items()}
    out, err = io.StringIO(), io.StringIO()
    exited = kwargs.pop("exited", ())
    summary = summarize_run(run_dir, ended=True, errors=errors, exited=exited)
    code = report(summary, failures, out=out, err=err, **kwargs)
    return code, out.getvalue(), err.getvalue()


def test_a_workers_error_is_its_diloco_error_line_of_this_launch(tmp_path):
    log = tmp_path / "worker-1.log"
    log.write_text("diloco: error: a mistake of the run before\n")
    offset = log.stat().st_size
    with log.open("a") as file:
        file.write("12:00:00 INFO diloco.worker.build: loading\ndiloco: error: the checkpoint is of another model\n")
    failure = failure_of_process(1, 2, log, offset)
    assert failure.message == "the checkpoint is of another model"
    assert failure.describe() == f"failed (exit code 2): the checkpoint is of another model; its log: {log}"


def test_a_crashed_workers_error_is_its_tracebacks_last_line_or_its_exit(tmp_path):
    log = tmp_path / "worker-0.log"
    log.write_text('Traceback (most recent call last):\n  File "x.py", line 1\n    f()\nRuntimeError: boom\n')
    with log.open("a") as file:
        file.write("12:00:01 INFO hivemind: shutting down\n")  # what its exit handlers wrote after
    assert failure_of_process(0, 1, log, 0).message == "RuntimeError: boom"
    assert failure_of_process(0, -9, log, 0).message == "killed by signal 9"
    assert failure_of_process(0, 1, log, log.stat().st_size).message == "it wrote nothing"
    assert failure_of_process(0, 1, tmp_path / "none.log", 0).message == "it wrote nothing"


def test_a_simulated_workers_error_is_one_line():
    assert failure_of_exception(ConfigError("bad value")) == Failure(2, "bad value")
    assert failure_of_exception(RuntimeError("boom\nmore detail")) == Failure(1, "RuntimeError: boom")
    assert failure_of_exception(StopRequested("faults.stop_after_round=1 reached")).describe() == (
        "stopped: faults.stop_after_round=1 reached"
    )


def test_every_worker_failing_at_its_start_of_one_mistake_is_that_one_error_line_and_exit_2(tmp_path):
    for worker in (0, 1):
        write_session(tmp_path, worker)  # the run before
        mark_start(tmp_path, worker)
    same = Failure(2, "the checkpoint is of another model", tmp_path / "worker-0.log")
    code, out, err = _report(tmp_path, {0: same, 1: Failure(2, same.message, tmp_path / "worker-1.log")})
    assert (code, out, err) == (2, "", "diloco: error: the checkpoint is of another model\n")


def test_a_failed_worker_is_a_line_on_stderr_and_exit_1(tmp_path):
    write_session(tmp_path, 0)
    mark_start(tmp_path, 1)
    code, out, err = _report(tmp_path, {1: Failure(1, "RuntimeError: boom", tmp_path / "worker-1.log")})
    assert code == 1
    assert "run " in out and "1 workers finished, failed: [1]" in out
    assert err == f"worker 1 failed (exit code 1): RuntimeError: boom; its log: {tmp_path / 'worker-1.log'}\n"


def test_workers_stopped_by_stop_after_round_exit_3(tmp_path):
    write_session(tmp_path, 0)
    write_session(tmp_path, 1, finished=False)
    code, _, err = _report(tmp_path, {1: Failure(3, "faults.stop_after_round=1 reached", tmp_path / "w.log")})
    assert code == 3 and err.startswith("worker 1 stopped (exit code 3): faults.stop_after_round=1 reached")


@pytest.mark.parametrize("may_differ, code", [(False, 4), (True, 0)])
def test_workers_that_end_on_different_params_exit_4_and_say_who_holds_which(tmp_path, may_differ, code):
    for worker, digest in enumerate(["ab" * 32, "cd" * 32, "ab" * 32]):
        write_session(tmp_path, worker, digest=digest)
    got, out, err = _report(tmp_path, {}, params_may_differ=may_differ)
    assert got == code and err == ""
    assert "params: DIFFER: sha256 abababababab on workers 0, 2 (val loss 2.0000); cdcdcdcdcdcd on worker 1" in out


def test_workers_that_end_on_the_same_params_exit_0(tmp_path):
    for worker in (0, 1):
        write_session(tmp_path, worker)
    code, out, _ = _report(tmp_path, {})
    assert code == 0 and "params: identical across 2 workers" in out


def test_scripts_that_exit_0_without_records_finished_and_exit_0(tmp_path):
    for worker in (0, 1):
        mark_start(tmp_path, worker)  # diloco launch starts a script of the user's that keeps no records
    assert _report(tmp_path, {})[0] == 1  # a worker whose exit the launcher did not see: failed
    code, out, err = _report(tmp_path, {}, exited={0, 1})
    assert (code, err) == (0, "")
    assert "2 workers finished\n" in out and "params: not recorded (no end records)" in out
    code, out, err = _report(tmp_path, {1: Failure(1, "RuntimeError: boom", tmp_path / "worker-1.log")}, exited={0})
    assert code == 1 and "1 workers finished, failed: [1]" in out and err.startswith("worker 1 failed (exit code 1)")
