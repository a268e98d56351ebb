"""The figures of ``diloco bench scale`` (``scale.py``) and its two tables.

``round_costs``: from the workers' round records, medians over the rounds after the first (which
also waits for the start-up) of the sync (``comm_s``), of a round's seconds, of each phase of
``phases_s`` and of the rest (a round's seconds outside the named phases: matchmaking,
downloading state, ...); each worker's peak RSS (its end record) over P, the params' fp32 bytes.
``pss_per_worker``: a run's memory per worker over P, as the peak of its process tree's summed PSS
less the same peak of the reference run (the smallest model, same workers and settings: the
launcher, the Python and PyTorch runtime, hivemind's daemons), over the workers.
``format_table``: a table of the sync against the stock baselines, and one of each worker's round
and memory.
"""

from __future__ import annotations

import statistics

from diloco.bench.scale_payload import BASELINES

NAMED_PHASES = ("training", "averaging", "hashing", "evaluating", "checkpointing")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def round_costs(records: list[list[dict]]) -> dict:
    """Medians over every worker's rounds after the first: ``comm_s``, each phase, the rest; and
    each worker's peak RSS over its parameters' fp32 bytes. ``records``: each worker's records."""
    later = [r for worker in records for r in worker if r.get("event") == "round" and r["round"] > 1]
    spent = [r.get("phases_s", {}) for r in later]
    names = sorted({name for phases in spent for name in phases})
    phases = {name: _median([round_phases.get(name, 0.0) for round_phases in spent]) for name in names}
    rest = [sum(p.values()) - sum(p.get(name, 0.0) for name in NAMED_PHASES) for p in spent]
    ends = [next(r for r in reversed(worker) if r.get("event") == "end") for worker in records]
    param_count = ends[0]["param_count"]
    return {
        "param_count": param_count,
        "workers": len(records),
        "rounds_measured": len(later) // max(1, len(records)),
        "sync_s": _median([r["comm_s"] for r in later]),
        "round_s": _median([sum(p.values()) for p in spent]),
        "phases_s": phases,
        "rest_s": _median(rest),
        "rounds_ok": all(r["ok"] and r["peers"] == len(records) for r in later),
        "peak_rss_per_param_byte": [end["peak_rss_bytes"] / (4 * end["param_count"]) for end in ends],
        "wall_s": [end["wall_s"] for end in ends],
        "compute_s": [end["compute_s"] for end in ends],
    }


def pss_per_worker(run: dict, reference: dict | None) -> float | None:
    """(the peak summed PSS of ``run``'s process tree - the same of ``reference``) / its workers / P;
    None when either has no such peak."""
    if not reference or "param_count" not in run or "memory" not in reference:
        return None
    above = run["memory"]["peak_pss_bytes"] - reference["memory"]["peak_pss_bytes"]
    return above / run["workers"] / (4 * run["param_count"])


def row_finished(row: dict) -> bool:
    restart = row.get("restart", {})
    return "error" not in row and all("error" not in row[kind] for kind in BASELINES) and "error" not in restart


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}" if ours is not None and theirs else "-"


def _download(join: dict) -> str:
    return f"{join['state_bytes'] / 1e6:.1f} MB in {join['download_s']:.2f} s" if "state_bytes" in join else "-"


def _rss(costs: dict) -> str:
    return f"{max(costs['peak_rss_per_param_byte']):.1f}" if "peak_rss_per_param_byte" in costs else "-"


def _pss(costs: dict, size: str, reference_size: str) -> str:
    if size == reference_size:
        return "reference"
    value = costs.get("pss_per_worker_per_param_byte")
    return "-" if value is None else f"{value:.1f}"


def _restart(restart: dict) -> str:
    if not restart:
        return "-"
    if "error" in restart:
        return restart["error"]
    ended = "identical" if restart["identical"] else "NOT identical"
    return (
        f"{ended} (killed at step {restart['killed_at_step']} of {restart['steps']}, "
        f"resumed from {restart['resumed_from']})"
    )


def _sync_line(row: dict) -> str:
    params, ours, plane = row["param_count"], row["sync_s"], row.get("plane", {}).get("sync_s")
    stock, gloo = (row.get(kind, {}).get("median_s") for kind in BASELINES)
    startup = [s for s in row["startup_s"] if s is not None]
    return (
        f"| {row['size']} | {params / 1e6:.2f} | {params * 4 / 1e6:.1f} | {_seconds(ours)} | {_seconds(plane)} | "
        f"{_seconds(stock)} | {_seconds(gloo)} | {_ratio(ours, stock)} | {_ratio(ours, gloo)} | "
        f"{_ratio(plane, stock)} | {_ratio(plane, gloo)} | {_seconds(max(startup, default=None))} | "
        f"{_download(row.get('join', {}))} | {_seconds(row.get('join', {}).get('join_startup_s'))} |"
    )


def _worker_line(row: dict, reference_size: str) -> str:
    phases, checkpointed = row["phases_s"], row.get("checkpointed", {})
    timed = [_seconds(row["round_s"])] + [_seconds(phases.get(name)) for name in NAMED_PHASES[:-1]]
    return (
        f"| {row['size']} | {' | '.join(timed)} | {_seconds(row['rest_s'])} | "
        f"{_ratio(checkpointed.get('round_s'), row['round_s'])} | "
        f"{_seconds(checkpointed.get('phases_s', {}).get('checkpointing'))} | "
        f"{_pss(row, row['size'], reference_size)} | {_pss(checkpointed, row['size'], reference_size)} | "
        f"{_rss(row)} | {_rss(checkpointed)} | {_restart(row.get('restart', {}))} |"
    )


SYNC_HEADER = (
    "| size | params (M) | fp32 MB | sync (ours) | sync (ours, gloo plane) | stock hivemind | gloo "
    "| ours/stock | ours/gloo | plane/stock | plane/gloo | start-up | a joiner's state download | its start-up |"
)
WORKER_HEADER = (
    "| size | round | training | averaging | hashing | evaluating | rest | checkpointed round / round "
    "| checkpointing | tree PSS / worker / P | the same, checkpointed | largest RSS / P | the same, checkpointed "
    "| kill -9 and restart |"
)


def _table(header: str, rows: list[dict], line) -> list[str]:
    lines = [header, "|" + " --- |" * (header.count("|") - 1)]
    for row in rows:
        lines.append(line(row) if "param_count" in row else f"| {row['size']} | {row.get('error', 'no result')} |")
    return lines


def format_table(rows: list[dict], *, steps: int, sync_every: int, workers: int, reference: dict | None = None) -> str:
    """The sync table, then the worker table (phases in seconds, memory over P = the params' fp32
    bytes; tree PSS less ``reference``'s, the smallest model's run), then each failed baseline."""
    reference_size = reference.get("size", "") if reference else ""
    lines = [
        f"{workers} workers on loopback, batch 2, {steps} inner steps, a round every {sync_every}; "
        "medians of the rounds after the first (seconds)",
        "",
        *_table(SYNC_HEADER, rows, _sync_line),
        "",
        *_table(WORKER_HEADER, rows, lambda row: _worker_line(row, reference_size)),
    ]
    if reference and "memory" in reference:
        runs = (reference, reference.get("checkpointed", {}))
        peaks = [run["memory"]["peak_pss_bytes"] / 1e9 for run in runs if "memory" in run]
        lines.append(
            f"tree PSS: the run's peak less the {reference_size} run's "
            f"({' and, checkpointed, '.join(f'{gb:.2f} GB' for gb in peaks)}), over {workers} workers and P"
        )
    failures = [
        f"{row['size']} {kind}: {row[kind]['error']}"
        for row in rows
        for kind in BASELINES
        if "error" in row.get(kind, {})
    ]
    return "\n".join([*lines, *failures])
