"""``diloco status``: who is in a live run, read from its roster on the DHT.

Every worker keeps a heartbeat record (``comm/hivemind/roster.py``) with its round, inner steps, latest
loss, tokens/s and validation loss, and what it is doing and for how long (``watchdog.py``:
training, matchmaking, averaging, downloading state, checkpointing, ...). A short-lived peer
reads them through any live peer's address and prints one line per worker, under a header with
the run's round (the newest any worker finished) and that round's validation loss. ``--watch``
reprints the table every few seconds: in place on a terminal, as a new block when piped to a file.

    diloco status --peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW... [--run-id ID] [--watch]
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TextIO

from diloco.comm.base import CommError
from diloco.comm.config import CommConfig
from diloco.comm.hivemind.roster import HEARTBEAT_S, worker_names
from diloco.comm.hivemind.roster_records import RosterEntry
from diloco.comm.members import nobody_answered
from diloco.worker.metrics import format_duration

_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: only ever written to a terminal


def format_status(run_id: str, entries: dict[int, RosterEntry], now: float) -> str:
    """The run's header and one line per worker. ``now`` is the DHT time the records are aged by."""
    live = {i: e for i, e in entries.items() if not e.leaving}
    if not entries:
        return f"run {run_id!r}: no live workers"
    newest = max(e.round for e in entries.values())
    newest_stats = [e.shows.stats for e in entries.values() if e.round == newest]
    losses = [stats["val_loss"] for stats in newest_stats if stats.get("val_loss") is not None]
    header = f"run {run_id!r}: {len(live)} live worker{'s' * (len(live) != 1)}, round {newest}"
    if losses:
        header += f", val_loss {min(losses):.4f}"
    lines = [
        header,
        f"{'worker':>6} {'round':>6} {'step':>7} {'tokens/s':>9} {'loss':>8} {'val_loss':>9}  {'phase':<26} last seen",
    ]
    for index, entry in sorted(entries.items()):
        stats = entry.shows.stats
        seen = f"{max(0.0, now - entry.written_at):.0f} s ago" if entry.written_at else "-"
        lines.append(
            f"{index:>6} {entry.round:>6} {entry.step:>7} {_number(stats.get('tokens_per_s'), '.0f'):>9}"
            f" {_number(stats.get('loss'), '.4f'):>8} {_number(stats.get('val_loss'), '.4f'):>9}"
            f"  {_phase(entry, now):<26} {seen}" + ("  (leaving)" if entry.leaving else "")
        )
    return "\n".join(lines + _split_lines(entries, live) + _excluded_lines(live))


def _split_lines(entries: dict[int, RosterEntry], live: dict[int, RosterEntry]) -> list[str]:
    """What says the run may be split: planned workers absent from the roster (not started yet,
    crashed, or cut off from the peer read through), and live workers that hold different params
    after one round (two sides of a split that found each other again, before they merge; as
    workers of blocking rounds declare them)."""
    lines = []
    planned = max((e.planned for e in live.values()), default=0)
    absent = [i for i in range(planned) if i not in entries]
    if absent:
        lines.append(
            f"not in the roster: {worker_names(absent)} of the {planned} planned (not started, crashed, or cut off "
            f"from the peer read through: a split run)"
        )
    models: dict[int, dict[str, list[int]]] = {}  # round -> params digest after it -> workers
    for index, entry in sorted(live.items()):
        if (declared := entry.params) is not None:
            models.setdefault(declared.rounds_done, {}).setdefault(declared.digest, []).append(index)
    split = [(r, held) for r, held in sorted(models.items()) if len(held) > 1]
    if split:
        round_index, held = split[-1]
        sides = sorted(held.items(), key=lambda item: -len(item[1]))
        text = " / ".join(f"{worker_names(workers)} (params {digest[:12]})" for digest, workers in sides)
        lines.append(f"split: {len(held)} models after round {round_index}: {text}")
    return lines


def _excluded_lines(live: dict[int, RosterEntry]) -> list[str]:
    """The workers the live workers exclude from their means (``comm.exclude_after``), and by how many."""
    by: dict[int, int] = {}
    for entry in live.values():
        excluded = entry.shows.stats.get("excluded")
        for index in excluded if isinstance(excluded, list) else ():
            if isinstance(index, int):
                by[index] = by.get(index, 0) + 1
    return [
        f"excluded from the run's means: worker {index} (by {count} of the {len(live)} live workers)"
        for index, count in sorted(by.items())
    ]


def _phase(entry: RosterEntry, now: float) -> str:
    """What the worker is doing and for how long: ``matchmaking for 12 s``."""
    phase, since = entry.shows.phase, entry.shows.phase_since
    if not phase:
        return "-"
    return f"{phase} for {format_duration(max(0.0, now - since))}" if since else phase


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def show_status(cfg: CommConfig, *, watch: bool, timeout_s: float, out: TextIO = sys.stdout) -> int:
    """Print the run's workers (``watch``: until Ctrl-C). Raises ``CommError`` when no worker of
    the run answers within ``timeout_s`` (and not watching): a wrong address, run id or run key."""
    from hivemind.utils import get_dht_time

    from diloco.comm.hivemind.peer import first_entries, roster_reader

    terminal = out.isatty()
    with roster_reader(cfg) as read:
        entries = first_entries(read, timeout_s)
        if not entries and not watch:
            raise CommError(nobody_answered(cfg.run_id, cfg.hivemind.initial_peers, timeout_s))
        shown = ""
        try:
            while True:
                text = format_status(cfg.run_id, entries, get_dht_time())
                if text != shown:  # piped: a new block only when something changed
                    out.write((_CLEAR if terminal else "\n" if shown else "") + text + "\n")
                    out.flush()
                    shown = text
                if not watch:
                    return 0
                time.sleep(HEARTBEAT_S)  # the records change once a heartbeat
                with contextlib.suppress(TimeoutError):  # a read the DHT did not answer: show the last again
                    entries = read()
        except KeyboardInterrupt:
            return 0
