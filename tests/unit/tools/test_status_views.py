"""What a user watches: ``diloco status``'s table, and ``diloco local``'s live view on a terminal
and in a log file."""

from __future__ import annotations

import io
import json

from diloco.comm.hivemind.roster_records import ParamsDeclaration, RosterEntry, Telemetry
from diloco.tools.launcher import _Progress, _watch
from diloco.tools.status import format_status


def test_status_table_names_the_runs_round_and_loss_and_marks_leaving_workers():
    entries = {
        0: RosterEntry(
            0,
            5,
            100,
            written_at=98.0,
            shows=Telemetry({"loss": 2.0, "tokens_per_s": 900.0, "val_loss": 2.1}, "matchmaking", 25.0),
        ),
        2: RosterEntry(2, 4, 90, leaving=True, written_at=90.0, shows=Telemetry({"val_loss": 2.3})),
    }
    text = format_status("r", entries, now=100.0)
    assert text.splitlines()[0] == "run 'r': 1 live worker, round 5, val_loss 2.1000"
    row = ["0", "5", "100", "900", "2.0000", "2.1000", "matchmaking", "for", "1:15", "2", "s", "ago"]
    assert text.splitlines()[2].split() == row  # in matchmaking for 75 s
    assert text.splitlines()[3].endswith("10 s ago  (leaving)") and " - " in text.splitlines()[3]
    assert format_status("r", {}, now=0.0) == "run 'r': no live workers"


def test_status_names_the_planned_workers_it_cannot_see_and_the_models_of_a_split_run():
    def entry(index: int, params: str) -> RosterEntry:
        return RosterEntry(index, 7, 140, written_at=99.0, params=ParamsDeclaration(7, params), planned=5)

    text = format_status("r", {0: entry(0, "aa" * 8), 1: entry(1, "aa" * 8), 3: entry(3, "bb" * 8)}, now=100.0)
    assert "not in the roster: workers 2, 4 of the 5 planned" in text
    assert "split: 2 models after round 7: workers 0, 1 (params aaaaaaaaaaaa) / worker 3 (params bbbbbbbbbbbb)" in text
    whole = format_status("r", {i: entry(i, "aa" * 8) for i in range(5)}, now=100.0)
    assert "split" not in whole and "not in the roster" not in whole
    # a worker that has started its next round still declares the params after the last one
    ahead = {i: entry(i, "aa" * 8) for i in range(5)}
    ahead[4] = RosterEntry(4, 8, 141, written_at=99.0, params=ParamsDeclaration(8, "cc" * 8), planned=5)
    assert "split" not in format_status("r", ahead, now=100.0)


def test_status_names_the_workers_the_live_ones_exclude_and_by_how_many():
    def entry(index: int, excluded: list) -> RosterEntry:
        return RosterEntry(index, 3, 60, written_at=99.0, shows=Telemetry({"excluded": excluded} if excluded else {}))

    text = format_status("r", {0: entry(0, [3]), 1: entry(1, [3]), 2: entry(2, []), 3: entry(3, [3])}, now=100.0)
    assert text.splitlines()[-1] == "excluded from the run's means: worker 3 (by 3 of the 4 live workers)"
    assert "excluded" not in format_status("r", {0: entry(0, []), 1: entry(1, [])}, now=100.0)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _progress_with_records(tmp_path) -> _Progress:
    """Records written after the view started (it skips what a resumed run had written before)."""
    progress = _Progress(tmp_path, 2)
    records = [
        {"event": "step", "step": 50, "round": 2, "loss": 2.5, "tokens_per_s": 1000.0},
        {"event": "round", "round": 2, "step": 40, "val_loss": 2.4, "peers": 2, "bytes_sent": 1_500_000},
        {"event": "round", "round": 3, "step": 60, "val_loss": 2.3, "peers": 2, "bytes_sent": 1_500_000},
    ]
    for i in range(2):
        (tmp_path / f"worker-{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[: 3 - i]))
    return progress


def test_local_live_view_shows_progress_eta_and_bytes_and_uses_control_codes_only_on_a_terminal(tmp_path):
    states = iter([["running", "running"], ["done", "done"]])
    piped = io.StringIO()
    _watch(_progress_with_records(tmp_path), 100, lambda: next(states), out=piped)
    text = piped.getvalue()
    assert "\x1b" not in text
    assert text.splitlines()[0].startswith("50% done") and "ETA" in text.splitlines()[0]
    assert "worker 0: step    50/100  round   3  loss 2.3000" in text and "sent 3.0 MB" in text
    assert "worker 1: step    50/100  round   2  loss 2.4000" in text and "sent 1.5 MB" in text

    states = iter([["running", "running"], ["done", "done"]])
    terminal, again = _Terminal(), tmp_path / "again"
    again.mkdir()
    _watch(_progress_with_records(again), 100, lambda: next(states), out=terminal)
    assert "\x1b[3F\x1b[J" in terminal.getvalue()  # the second view redraws the first's 3 lines
    assert "sent 3.0 MB" in terminal.getvalue()
