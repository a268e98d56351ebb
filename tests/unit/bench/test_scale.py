"""``diloco bench scale``'s logic, without processes: the per-round medians and the rest from
round records, the table, the size checks, and that every size's overrides are real keys."""

from __future__ import annotations

import json

import pytest

from diloco.bench import scale
from diloco.config import load_config


def _round(number: int, comm_s: float, **phases: float) -> dict:
    return {"event": "round", "round": number, "comm_s": comm_s, "ok": True, "peers": 2, "phases_s": phases}


def _end(param_count: int = 1000, peak_rss_bytes: int = 40_000) -> dict:
    return {"event": "end", "param_count": param_count, "peak_rss_bytes": peak_rss_bytes, "wall_s": 9.0, "compute_s": 3}


def _worker(offset: float) -> list[dict]:
    """Round 1 (start-up, left out), then rounds 2 to 4; worker 1's figures are worker 0's + ``offset``."""
    return [
        {"event": "step", "step": 1, "time_s": 0.1},
        _round(1, 50.0, starting=40.0, training=1.0, averaging=50.0, hashing=0.1, evaluating=0.5),
        _round(2, 1.0 + offset, training=1.0, averaging=1.0 + offset, hashing=0.1, evaluating=0.5, checkpointing=0.2),
        _round(3, 2.0 + offset, training=1.0, averaging=2.0 + offset, hashing=0.1, evaluating=0.5, checkpointing=0.2),
        _round(4, 3.0 + offset, training=1.0, averaging=3.0 + offset, matchmaking=0.7, checkpointing=0.2),
        _end(peak_rss_bytes=40_000 + int(offset * 4000)),
    ]


def test_round_costs_are_medians_over_both_workers_of_the_rounds_after_the_first():
    costs = scale.round_costs([_worker(0.0), _worker(1.0)])
    assert costs["param_count"] == 1000 and costs["rounds_measured"] == 3
    assert costs["sync_s"] == 2.5  # of 1, 2, 3, 2, 3, 4: round 1's 50 s is start-up
    assert costs["round_s"] == pytest.approx(4.3)  # of 2.8, 3.8, 4.9, 3.8, 4.8, 5.9
    assert costs["phases_s"]["checkpointing"] == 0.2
    assert costs["phases_s"]["hashing"] == 0.1  # round 4 has none: counted as 0, median of 0.1 x 4, 0 x 2
    assert "starting" not in costs["phases_s"]
    assert costs["rest_s"] == pytest.approx(0.0) and costs["phases_s"]["matchmaking"] == 0.0
    assert costs["peak_rss_per_param_byte"] == [10.0, 11.0]
    assert costs["rounds_ok"]


def test_the_rest_is_a_rounds_seconds_outside_the_named_phases():
    unnamed = {"downloading state": 2.0, "matchmaking": 1.0}
    records = [_round(1, 1.0, training=1.0), *[_round(r, 1.0, training=1.0, **unnamed) for r in (2, 3)], _end()]
    costs = scale.round_costs([records, records])
    assert costs["rest_s"] == pytest.approx(3.0)


def test_a_round_over_fewer_workers_is_not_ok():
    partial = _worker(0.0)
    partial[2] = {**partial[2], "peers": 1}
    assert not scale.round_costs([partial, _worker(0.0)])["rounds_ok"]


def _row(size: str = "10m", **changes) -> dict:
    row = {
        "size": size,
        "param_count": 10_000_000,
        "sync_s": 2.0,
        "phases_s": {"evaluating": 0.25, "hashing": 0.125},
        "rest_s": 0.0,
        "peak_rss_per_param_byte": [5.0, 6.0],
        "startup_s": [10.0, None],
        "round_s": 4.0,
        "checkpointed": {"round_s": 5.0, "phases_s": {"checkpointing": 0.5}, "peak_rss_per_param_byte": [9.0, 8.0]},
        "hivemind": {"kind": "hivemind", "median_s": 4.0},
        "gloo": {"kind": "gloo", "median_s": 0.5},
        "plane": {"sync_s": 1.0},
        "join": {"state_bytes": 80_000_000, "download_s": 1.5, "join_startup_s": 20.0},
    }
    return {**row, **changes}


def test_the_table_has_a_row_per_size_with_ratios_of_both_data_planes_to_both_baselines_and_of_a_checkpointed_round():
    table = scale.format_table([_row()], steps=8, sync_every=2)
    row = table.splitlines()[-1]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells == [
        "10m", "10.00", "40.0", "2.000", "1.000", "4.000", "0.500", "0.50", "4.00", "0.25", "2.00", "4.000", "1.25",
        "0.500", "0.250", "0.125", "0.000", "6.0", "9.0", "10.000", "80.0 MB in 1.50 s", "20.000",
    ]  # fmt: skip
    header = table.splitlines()[2]
    assert header.count("|") == row.count("|")


def test_a_failed_run_and_a_failed_baseline_say_so_in_the_table():
    failed = {"size": "85m", "exit_code": 1, "error": "training exited 1; see runs/85m/worker-*.log"}
    no_gloo = _row("baby", gloo={"kind": "gloo", "error": "no result within 200 s"})
    table = scale.format_table([failed, no_gloo], steps=8, sync_every=2)
    assert "| 85m | training exited 1" in table
    assert "| 2.000 | 1.000 | 4.000 | - | 0.50 | - | 0.25 | - |" in table
    assert table.splitlines()[-1] == "baby gloo: no result within 200 s"
    assert not scale.row_finished(no_gloo) and not scale.row_finished(failed) and scale.row_finished(_row())


def test_an_unknown_size_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert scale.run_scale_benchmark(sizes=["baby", "x"], steps=8, sync_every=2, compare_rounds=3, out=tmp_path) == 2
    err = capsys.readouterr().err
    assert err == "bench scale: unknown size 'x': baby, 10m, 85m, llama-150m\n"
    assert not (tmp_path / "results.json").exists()


def test_llama_150m_without_transformers_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr("diloco.optional_deps.is_installed", lambda module: False)
    message = scale.size_error(["baby", "llama-150m"])
    assert "\n" not in message and message.startswith("bench scale: llama-150m") and "pip install -e .[hf]" in message
    assert scale.size_error(["baby", "10m", "85m"]) is None


def test_too_few_rounds_to_measure_one_after_the_first(tmp_path, capsys):
    assert scale.run_scale_benchmark(sizes=["baby"], steps=2, sync_every=2, compare_rounds=3, out=tmp_path) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("size", sorted(scale.SIZES))
def test_every_size_is_a_valid_config(size, tmp_path, monkeypatch):
    monkeypatch.setattr("diloco.config.checks.is_installed", lambda module: True)  # llama-150m: checked, not built
    overrides = scale.training_overrides(size, steps=8, sync_every=2, run_dir=tmp_path)
    cfg = load_config(scale.CONFIG, overrides)
    assert (cfg.inner.batch_size, cfg.inner.steps, cfg.outer.sync_every, cfg.checkpoint.every_rounds) == (2, 8, 2, 1)
    without = scale.training_overrides(size, steps=8, sync_every=2, run_dir=tmp_path, checkpoints=False)
    assert load_config(scale.CONFIG, without).checkpoint.every_rounds == 0
    assert cfg.comm.deadline_s == 900 and cfg.worker.threads == 1 and cfg.logging.log_every == 1
    assert cfg.model.block_size == (64 if size == "baby" else 128)


def test_the_first_step_clock_notes_when_each_worker_writes_a_step_record(tmp_path):
    with scale.FirstStepClock(tmp_path, 2, poll_s=0.01) as clock:
        (tmp_path / "worker-1.jsonl").write_text(json.dumps({"event": "step", "step": 1}) + "\n")
        for _ in range(200):
            if clock.seconds[1] is not None:
                break
            clock._stop.wait(0.01)
    assert clock.seconds[0] is None and clock.seconds[1] is not None and clock.seconds[1] >= 0
