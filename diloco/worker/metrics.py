"""Metrics sinks, so the training loop never branches on "is logging on".

- ``JsonlWriter``: one JSON object per line in ``<run_dir>/worker-<i>.jsonl``, flushed per line. This is
  the record that benchmarks and plots read (its files: README.md, "Quick start").
- ``build_wandb_logger``: a ``WandbLogger`` for ``logging.wandb=offline|online``, else a ``NullLogger``
  with the same methods.
- ``summarize_run`` / ``write_summary`` / ``format_summary``: build ``summary.json`` from the workers'
  records of their latest session (from their last ``"event": "start"`` record on: a rerun appends
  to the same files) and print it.

Sync an offline wandb run later with ``wandb sync runs/<name>/wandb/offline-run-*``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.config.schema import WANDB_MODES, LoggingConfig

logger = logging.getLogger(__name__)

_WORKER_FILE_RE = re.compile(r"^worker-(\d+)\.jsonl$")


def _to_jsonable(value: Any) -> Any:
    """``json.dumps`` fallback: tensors and numpy values to Python numbers / lists."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


class JsonlWriter:
    """Appends records to ``<run_dir>/worker-<i>.jsonl``; each line is flushed, so a crash loses nothing
    already logged. Appending (not truncating) lets a restarted worker continue the same file."""

    def __init__(self, run_dir: Path, worker_index: int) -> None:
        self.path = Path(run_dir) / f"worker-{worker_index}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=_to_jsonable) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullLogger:
    """Does nothing, with ``WandbLogger``'s methods."""

    def log(self, record: dict[str, Any], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger:
    """Wraps a wandb run. Numeric fields of a record are logged as ``<event>/<field>`` (``step/loss``,
    ``round/val_loss``) so step and round records chart in separate sections; strings are dropped."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, record: dict[str, Any], step: int) -> None:
        prefix = f"{record['event']}/" if isinstance(record.get("event"), str) else ""
        values = {}
        for key, value in record.items():
            if isinstance(value, torch.Tensor | np.generic):
                value = _to_jsonable(value)
            if isinstance(value, int | float) and not isinstance(value, bool):
                values[prefix + key] = value
        self.run.log(values, step=step)

    def finish(self) -> None:
        # wandb-core may flush the offline .wandb file a moment after this returns; process exit (or
        # wandb.teardown()) waits for it.
        self.run.finish()


def build_wandb_logger(
    cfg: LoggingConfig, *, run_dir: Path, run_name: str, worker_index: int, config_dict: dict[str, Any]
) -> WandbLogger | NullLogger:
    """A ``NullLogger`` when ``cfg.wandb == "disabled"``, else one wandb run per worker, grouped by run."""
    if cfg.wandb not in WANDB_MODES:
        raise ValueError(f"logging.wandb must be one of {', '.join(WANDB_MODES)}; got {cfg.wandb!r}")
    if cfg.wandb == "disabled":
        return NullLogger()
    import wandb  # slow to import: only when asked for

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=cfg.project,
        dir=str(run_dir),
        mode=cfg.wandb,
        group=run_name,
        name=f"{run_name}-worker-{worker_index}",
        config=config_dict,
        # One run per worker even when several workers share a process; keep our progress lines readable.
        reinit="create_new",
        settings=wandb.Settings(silent=True, console="off"),
    )
    logger.info("wandb %s run %s in %s", cfg.wandb, run.name, run_dir)
    return WandbLogger(run)


def format_duration(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on: for progress lines and ETAs."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


def _read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # e.g. a line cut short by a crash
                logger.warning("%s:%d: skipping unparseable line", path, number)
    return records


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


def start_record(worker: int) -> dict[str, Any]:
    """The record that opens a session of worker ``worker``'s file: written by the launcher that
    starts the worker (before it starts) and by the worker when its records open. ``pid`` and
    ``host``: the process that wrote it, which tells a reader whether that session may still run."""
    return {
        "event": "start",
        "worker": worker,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "unix_time": round(time.time(), 3),
    }


def mark_start(run_dir: Path, worker: int) -> None:
    """Open a new session in worker ``worker``'s records (``start_record``), before starting it."""
    with JsonlWriter(run_dir, worker) as writer:
        writer.log(start_record(worker))


def worker_files(run_dir: Path) -> list[tuple[int, Path]]:
    """The ``worker-<i>.jsonl`` files of ``run_dir`` as (i, path), by worker index."""
    files = []
    for path in Path(run_dir).iterdir():
        if match := _WORKER_FILE_RE.match(path.name):
            files.append((int(match.group(1)), path))
    return sorted(files)


def session_records(path: Path) -> list[dict[str, Any]]:
    """A worker's records of its latest session: from its last ``start`` record on (its file is
    appended to by every rerun of the run; a file from before start records: all of it)."""
    records = _read_records(path)
    starts = [i for i, record in enumerate(records) if record.get("event") == "start"]
    return records[starts[-1] :] if starts else records


def _latest_start(sessions: dict[int, list[dict[str, Any]]]) -> float | None:
    """When the latest of the workers' ``sessions`` began (its ``start`` record's time)."""
    starts = [session[0].get("unix_time") for session in sessions.values() if session]
    return max((t for t in starts if t is not None), default=None)


def _may_run(session: list[dict[str, Any]]) -> bool:
    """Whether the process that opened ``session`` is alive on this machine (a worker, or the
    launcher that is starting it); False when that cannot be told (another machine, no start)."""
    start = session[0] if session and session[0].get("event") == "start" else None
    if start is None or start.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(start["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _progress(index: int, session: list[dict[str, Any]], state: str) -> dict[str, Any]:
    """Where worker ``index`` stands in its session: its latest step, round and losses."""
    latest: dict[str, dict[str, Any]] = {}
    for record in session:
        latest[record.get("event", "")] = record
    step, rnd, end = latest.get("step", {}), latest.get("round", {}), latest.get("end", {})
    return {
        "worker": index,
        "state": state,
        "step": end.get("inner_steps", max(step.get("step", 0), rnd.get("step", 0))),
        "round": end.get("rounds", rnd.get("round", 0)),
        "loss": step.get("loss"),
        "val_loss": end.get("val_loss", rnd.get("val_loss")),
    }


def _outcomes(
    sessions: dict[int, list[dict[str, Any]]], ended: bool, errors: dict[int, str], exited: Collection[int]
) -> tuple[list[dict], list[dict]]:
    """Each worker's end record of its session (finished ones) and where each stands (all)."""
    ends, progress = [], []
    for index, session in sessions.items():
        end = next((r for r in reversed(session) if r.get("event") == "end"), None)
        if index in errors:
            state = "failed"
        elif end is not None or index in exited:
            state = "finished"
            ends.extend([end] if end is not None else [])
        else:
            state = "running" if not ended and _may_run(session) else "failed"
        progress.append(_progress(index, session, state))
    return ends, progress


def summarize_run(
    run_dir: Path, *, ended: bool = False, errors: dict[int, str] | None = None, exited: Collection[int] = ()
) -> dict[str, Any]:
    """Build the summary.json dict (its fields: README.md) from every ``worker-*.jsonl`` in ``run_dir``,
    each read from its latest session on (``session_records``).

    A worker counts as finished when its session holds an ``"event": "end"`` record, or its
    launcher saw its process exit 0 (``exited``: a script of the user's under ``diloco launch``
    may keep no records), unless ``errors`` (worker -> one line: what its launcher saw) says it
    failed; one without is running while the process that opened its session is (unless the
    caller knows the run ``ended``), else failed. Per-worker quantities are means over the end
    records, ``tokens`` is their sum.
    """
    errors = errors or {}
    sessions = {index: session_records(path) for index, path in worker_files(Path(run_dir))}
    ends, progress = _outcomes(sessions, ended, errors, exited)

    def mean_of(key: str) -> float | None:
        return _mean([float(e[key]) for e in ends if e.get(key) is not None])

    compute_s, wall_s = mean_of("compute_s"), mean_of("wall_s")
    bytes_sent, bytes_recv = mean_of("bytes_sent"), mean_of("bytes_recv")
    utilization = compute_s / wall_s if compute_s is not None and wall_s else None
    hashes = [e.get("param_sha256") for e in ends]
    return {
        "run": Path(run_dir).name,
        "workers": sum(p["state"] == "finished" for p in progress),
        "inner_steps": max((int(e["inner_steps"]) for e in ends), default=0),
        "rounds": max((int(e["rounds"]) for e in ends), default=0),
        "tokens": sum(int(e.get("tokens", 0)) for e in ends),
        "final_val_loss": _rounded(mean_of("val_loss"), 4),
        "bytes_sent": None if bytes_sent is None else round(bytes_sent),
        "bytes_recv": None if bytes_recv is None else round(bytes_recv),
        "peak_sync_bytes": max((int(e.get("peak_sync_bytes", 0)) for e in ends), default=0),
        "compute_s": _rounded(compute_s, 3),
        "comm_wait_s": _rounded(mean_of("comm_wait_s"), 3),
        "wall_s": _rounded(wall_s, 3),
        "compute_utilization": _rounded(utilization, 4),
        "param_sha256": hashes,
        "params_agree": len(hashes) > 0 and None not in hashes and len(set(hashes)) == 1,
        "models": models_of(ends),
        "failed_workers": [p["worker"] for p in progress if p["state"] == "failed"],
        "running_workers": [p["worker"] for p in progress if p["state"] == "running"],
        "errors": {str(index): errors[index] for index in sorted(errors)},
        # when the latest session began: which launch a summary.json tells of (diloco summary)
        "began": _latest_start(sessions),
        "progress": progress,
        "per_worker": ends,
    }


def models_of(ends: list[dict]) -> list[dict[str, Any]]:
    """The models the workers ended on (one unless the run ended split): each with its workers,
    params digest and final val loss, the most held first."""
    models: dict[str | None, dict[str, Any]] = {}
    for end in ends:
        model = models.setdefault(end.get("param_sha256"), {"workers": [], "param_sha256": end.get("param_sha256")})
        model["workers"].append(end.get("worker"))
        model["val_loss"] = end.get("val_loss")
    return sorted(models.values(), key=lambda m: -len(m["workers"]))


def write_summary(
    run_dir: Path,
    *,
    ended: bool = False,
    errors: dict[int, str] | None = None,
    exited: Collection[int] = (),
    unless_running: bool = False,
) -> dict[str, Any]:
    """``summarize_run`` and write it to ``<run_dir>/summary.json`` atomically (temp file + rename);
    with ``unless_running``, only when no worker of the directory runs: workers of one run sharing
    a directory each try at their end, and the last to end writes it (each writes its end record
    first, so two ending at once do not both skip it)."""
    summary = summarize_run(run_dir, ended=ended, errors=errors, exited=exited)
    if unless_running and summary["running_workers"]:
        return summary
    run_dir = Path(run_dir)
    fd, tmp_name = tempfile.mkstemp(dir=run_dir, prefix=".summary.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        os.replace(tmp_name, run_dir / "summary.json")
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return summary


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _workers(indices: list[int]) -> str:
    """``worker 1`` or ``workers 0, 2``."""
    return ("worker " if len(indices) == 1 else "workers ") + ", ".join(map(str, indices))


def format_failures(summary: dict[str, Any]) -> list[str]:
    """One line per failed worker of a summary, with its error where its launcher saw one (``errors``)."""
    errors = summary.get("errors") or {}
    return [
        f"worker {index} {errors.get(str(index), 'failed: it ended without an end record')}"
        for index in summary.get("failed_workers") or []
    ]


def format_summary(summary: dict[str, Any]) -> str:
    """A few human-readable lines with the main fields of a summary dict."""
    mb = 1e6
    sent, recv = summary.get("bytes_sent"), summary.get("bytes_recv")
    failed, running = summary.get("failed_workers") or [], summary.get("running_workers") or []
    hashes = summary.get("param_sha256") or []
    if not hashes:
        params = "params: not recorded (no end records)" if summary["workers"] else "params: no finished worker"
    elif len(set(hashes)) == 1 and hashes[0] is not None:
        params = f"params: identical across {len(hashes)} workers (sha256 {hashes[0][:12]})"
    else:  # a split run, or a bug: which workers hold which params
        params = "params: DIFFER: sha256 " + "; ".join(
            f"{(model.get('param_sha256') or 'none')[:12]} on {_workers(model['workers'])}"
            f" (val loss {_fmt(model.get('val_loss'), '.4f')})"
            for model in summary.get("models") or []
        )
    lines = [
        f"run {summary.get('run', '?')}: {summary['workers']} workers finished"
        + (f", failed: {failed}" if failed else "")
        + (f", running: {running}" if running else ""),
        f"inner steps {summary['inner_steps']}, rounds {summary['rounds']}, tokens {summary['tokens']:,}",
        f"final val loss {_fmt(summary['final_val_loss'], '.4f')}",
        f"per worker: sent {_fmt(None if sent is None else sent / mb, '.2f', ' MB')}, "
        f"received {_fmt(None if recv is None else recv / mb, '.2f', ' MB')}",
        f"per worker: compute {_fmt(summary['compute_s'], '.1f', ' s')}, "
        f"comm wait {_fmt(summary['comm_wait_s'], '.1f', ' s')}, "
        f"wall {_fmt(summary['wall_s'], '.1f', ' s')}, "
        f"utilization {_fmt(summary['compute_utilization'], '.3f')}",
        params,
    ]
    return "\n".join(lines)
