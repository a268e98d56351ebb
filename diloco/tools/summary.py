"""``diloco summary RUN_DIR``: a run at a glance from its records, live or finished.

Reads each ``worker-<i>.jsonl`` from its latest session on (``metrics.summarize_run``), for the
run directory of any command (``local``, ``testbed``, ``train``, the simulator). While a worker
runs (its process is alive on this machine and wrote no end record): one line per worker, its
latest step, round and losses, ``running``, ``finished`` or ``failed``. Once none runs: the
summary ``diloco local`` prints at its end, and a line per failed worker (with the error its
launcher saw, kept in ``summary.json``, as is which workers it saw finish). It writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from diloco.errors import UsageError
from diloco.worker.metrics import format_failures, format_summary, summarize_run, worker_files


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def progress_lines(summary: dict) -> list[str]:
    """A live run: a header, then per worker its state, latest step and round, loss and val loss."""
    finished = sum(p["state"] == "finished" for p in summary["progress"])
    lines = [f"run {summary['run']}: running, {finished} of {len(summary['progress'])} workers finished"]
    for p in summary["progress"]:
        lines.append(
            f"  worker {p['worker']}: {p['state']:<8}  step {p['step']:>6}  round {p['round']:>4}"
            f"  loss {_fmt(p['loss'])}  val loss {_fmt(p['val_loss'])}"
        )
    return lines


def launcher_outcomes(run_dir: Path, began: float | None) -> tuple[dict[int, str], set[int]]:
    """What its launcher saw of the workers, from ``summary.json`` when that tells of the launch
    whose sessions ``began`` then (else it tells of an earlier run of the directory): the failed
    workers' errors, and the workers it saw finish (a script of the user's under ``diloco launch``
    may keep no end record)."""
    path = run_dir / "summary.json"
    try:
        written = json.loads(path.read_text())
        if written.get("began") != began or began is None:
            return {}, set()
        errors = {int(index): error for index, error in written.get("errors", {}).items()}
        finished = {int(p["worker"]) for p in written.get("progress", []) if p.get("state") == "finished"}
        return errors, finished
    except (OSError, ValueError, AttributeError, KeyError, TypeError):  # none, or not a summary this version wrote
        return {}, set()


def summary_text(run_dir: Path) -> str:
    """What ``diloco summary RUN_DIR`` prints; ``UsageError`` for a directory that holds no run."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a directory: give a run directory (run.dir, e.g. runs/<run.name>)")
    if not worker_files(run_dir):
        raise UsageError(f"{run_dir} has no worker-*.jsonl records: give a run directory (run.dir) a run wrote")
    summary = summarize_run(run_dir)
    errors, finished = launcher_outcomes(run_dir, summary["began"])
    if errors or finished:
        summary = summarize_run(run_dir, errors=errors, exited=finished)
    if summary["running_workers"]:
        return "\n".join(progress_lines(summary))
    return "\n".join([format_summary(summary), *format_failures(summary)])
