"""How a run of ``diloco local`` ended: each failed worker's one-line error, and the exit code.

A worker process's error is the ``diloco: error: ...`` line it left in ``worker-<i>.log`` (the
part of the log this launch wrote), else the last line it wrote there (a traceback's last line:
the exception), else its exit code; a simulated worker's is its exception's message. Exit codes:

    0  every worker finished, on the same params
    1  a worker failed
    2  every worker failed at its start with the same user error (the one line: ``diloco: error: ...``)
    3  every worker that did not finish was stopped by ``faults.stop_after_round``
    4  every worker finished, but their params differ (not expected: ``outer.eager`` excepted)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from diloco.errors import UserError
from diloco.worker.faults import StopRequested
from diloco.worker.metrics import format_failures, format_summary

EXIT_FAILED, EXIT_USER_ERROR, EXIT_STOPPED, EXIT_PARAMS_DIFFER = 1, 2, 3, 4
ERROR_PREFIX = "diloco: error: "


@dataclass(frozen=True)
class Failure:
    """A worker that did not finish: the code its process exited with (a simulated worker's: the one
    ``diloco train`` would have exited with), and one line saying why."""

    code: int
    message: str
    log: Path | None = None  # a worker process's log

    def describe(self) -> str:
        """``failed (exit code 2): MESSAGE; its log: PATH`` (``stopped`` for ``faults.stop_after_round``)."""
        verb = "stopped" if self.code == EXIT_STOPPED else "failed"
        if self.log is None:
            return f"{verb}: {self.message}"
        return f"{verb} (exit code {self.code}): {self.message}; its log: {self.log}"


def failure_of_process(index: int, code: int, log: Path, offset: int) -> Failure:
    """Worker ``index``'s failure from its exit ``code`` and what it wrote to ``log`` from ``offset`` on."""
    try:
        with log.open("rb") as file:
            file.seek(offset)
            lines = [line.rstrip() for line in file.read().decode(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        lines = []
    errors = [line.removeprefix(ERROR_PREFIX) for line in lines if line.startswith(ERROR_PREFIX)]
    stopped = [line for line in lines if line.startswith(f"worker {index} stopped: ")]
    if errors:
        message = errors[-1]
    elif code == EXIT_STOPPED and stopped:
        message = stopped[-1].removeprefix(f"worker {index} stopped: ")
    elif code < 0:
        message = f"killed by signal {-code}"
    else:
        message = _exception_line(lines) or (lines[-1] if lines else "it wrote nothing")
    return Failure(code, message, log)


def _exception_line(lines: list[str]) -> str | None:
    """The exception of the last traceback in ``lines``: its first line not indented (the frames are)."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return None
    return next((line for line in lines[starts[-1] + 1 :] if not line[0].isspace()), None)


def failure_of_exception(error: BaseException) -> Failure:
    """A simulated worker's failure: its exception as one line, with the code ``diloco train`` gives it."""
    if isinstance(error, StopRequested):
        return Failure(EXIT_STOPPED, str(error))
    lines = str(error).strip().splitlines()
    if isinstance(error, UserError):
        return Failure(EXIT_USER_ERROR, lines[0] if lines else type(error).__name__)
    return Failure(EXIT_FAILED, f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__)


def _one_user_error(summary: dict, failures: dict[int, Failure]) -> str | None:
    """The user error every worker failed with before its first step, if they all failed of one."""
    progress = summary.get("progress") or []
    codes = {failure.code for failure in failures.values()}
    messages = {failure.message for failure in failures.values()}
    started = any(p["step"] for p in progress)
    if len(failures) == len(progress) and codes == {EXIT_USER_ERROR} and len(messages) == 1 and not started:
        return messages.pop()
    return None


def report(
    summary: dict,
    failures: dict[int, Failure],
    *,
    params_may_differ: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Print how the run ended: the summary on ``out``, each failed worker's line on ``err`` (or only
    the one user error every worker failed with); return the exit code (this module's docstring)."""
    out, err = out or sys.stdout, err or sys.stderr
    if (message := _one_user_error(summary, failures)) is not None:
        print(ERROR_PREFIX + message, file=err)
        return EXIT_USER_ERROR
    print(format_summary(summary), file=out, flush=True)
    for line in format_failures(summary):
        print(line, file=err)
    err.flush()
    if summary["failed_workers"]:
        stopped = all(failures.get(i, Failure(EXIT_FAILED, "")).code == EXIT_STOPPED for i in summary["failed_workers"])
        return EXIT_STOPPED if stopped else EXIT_FAILED
    if not summary["params_agree"] and len(summary["param_sha256"]) > 1 and not params_may_differ:
        return EXIT_PARAMS_DIFFER
    return 0
