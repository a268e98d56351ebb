"""``diloco bench scale``'s figures and tables, without processes: the per-round medians and the
rest from round records, a worker's tree PSS over the reference run's, the two tables."""

from __future__ import annotations

import pytest

from diloco.bench import scale_report


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
    costs = scale_report.round_costs([_worker(0.0), _worker(1.0)])
    assert costs["param_count"] == 1000 and costs["rounds_measured"] == 3 and costs["workers"] == 2
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
    costs = scale_report.round_costs([records, records])
    assert costs["rest_s"] == pytest.approx(3.0)


def test_a_round_over_fewer_workers_is_not_ok():
    partial = _worker(0.0)
    partial[2] = {**partial[2], "peers": 1}
    assert not scale_report.round_costs([partial, _worker(0.0)])["rounds_ok"]


def test_a_workers_memory_is_the_trees_peak_pss_above_the_reference_runs_per_worker_over_its_param_bytes():
    run = {"param_count": 1_000_000, "workers": 2, "memory": {"peak_pss_bytes": 3_000_000_000}}
    reference = {"memory": {"peak_pss_bytes": 1_000_000_000}}
    assert scale_report.pss_per_worker(run, reference) == 250.0  # 2 GB over 2 workers of 4 MB
    assert scale_report.pss_per_worker(run, None) is None
    assert scale_report.pss_per_worker({"error": "training exited 1"}, reference) is None


def _row(size: str = "10m", **changes) -> dict:
    row = {
        "size": size,
        "param_count": 10_000_000,
        "workers": 2,
        "sync_s": 2.0,
        "phases_s": {"training": 1.5, "averaging": 2.25, "evaluating": 0.25, "hashing": 0.125},
        "rest_s": 0.0,
        "peak_rss_per_param_byte": [5.0, 6.0],
        "pss_per_worker_per_param_byte": 4.25,
        "startup_s": [10.0, None],
        "round_s": 4.0,
        "checkpointed": {
            "round_s": 5.0,
            "phases_s": {"checkpointing": 0.5},
            "peak_rss_per_param_byte": [9.0, 8.0],
            "pss_per_worker_per_param_byte": 7.5,
        },
        "hivemind": {"kind": "hivemind", "median_s": 4.0},
        "gloo": {"kind": "gloo", "median_s": 0.5},
        "plane": {"sync_s": 1.0},
        "join": {"state_bytes": 80_000_000, "download_s": 1.5, "join_startup_s": 20.0},
        "restart": {"identical": True, "killed_at_step": 3, "steps": 6, "resumed_from": "own"},
    }
    return {**row, **changes}


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip("|").split("|")]


def _tables(rows: list[dict], reference: dict | None = None) -> list[list[str]]:
    text = scale_report.format_table(rows, steps=8, sync_every=2, workers=2, reference=reference)
    return [block.splitlines() for block in text.split("\n\n")[1:]]


def test_the_sync_table_has_ratios_of_both_data_planes_to_both_baselines_the_start_up_and_the_download():
    sync, _ = _tables([_row()])
    assert _cells(sync[-1]) == [
        "10m", "10.00", "40.0", "2.000", "1.000", "4.000", "0.500", "0.50", "4.00", "0.25", "2.00", "10.000",
        "80.0 MB in 1.50 s", "20.000",
    ]  # fmt: skip
    assert sync[0].count("|") == sync[-1].count("|")


def test_the_worker_table_has_each_phase_the_checkpointed_round_memory_over_p_and_the_restart():
    _, worker = _tables([_row()])
    assert _cells(worker[2]) == [
        "10m", "4.000", "1.500", "2.250", "0.125", "0.250", "0.000", "1.25", "0.500", "4.2", "7.5", "6.0", "9.0",
        "identical (killed at step 3 of 6, resumed from own)",
    ]  # fmt: skip
    assert worker[0].count("|") == worker[2].count("|")


def test_the_reference_size_is_named_so_and_its_peaks_are_printed_under_the_tables():
    baby = _row("baby", memory={"peak_pss_bytes": 1_500_000_000})
    baby["checkpointed"] = {**baby["checkpointed"], "memory": {"peak_pss_bytes": 2_000_000_000}}
    _, worker = _tables(
        [baby, _row(restart={"identical": False, "killed_at_step": 5, "steps": 6, "resumed_from": None})], baby
    )
    assert _cells(worker[2])[9:11] == ["reference", "reference"]
    assert _cells(worker[3])[-1] == "NOT identical (killed at step 5 of 6, resumed from None)"
    assert worker[-1].startswith("tree PSS: the run's peak less the baby run's (1.50 GB and, checkpointed, 2.00 GB)")


def test_a_refused_size_a_failed_run_and_a_failed_baseline_say_so_in_the_tables():
    refused = {"size": "300m", "error": "refused: the model has 302.7M parameters (1.1 GiB in fp32): ..."}
    failed = {"size": "85m", "exit_code": 1, "error": "training exited 1; see runs/85m/worker-*.log"}
    no_gloo = _row("baby", gloo={"kind": "gloo", "error": "no result within 200 s"})
    text = scale_report.format_table([refused, failed, no_gloo], steps=8, sync_every=2, workers=2)
    assert text.count("| 300m | refused: the model has 302.7M parameters") == 2  # a row of each table
    assert "| 85m | training exited 1" in text
    assert "| 2.000 | 1.000 | 4.000 | - | 0.50 | - | 0.25 | - |" in text
    assert text.splitlines()[-1] == "baby gloo: no result within 200 s"
    assert not scale_report.row_finished(no_gloo) and not scale_report.row_finished(failed)
    assert not scale_report.row_finished(refused) and scale_report.row_finished(_row())
    assert not scale_report.row_finished(_row(restart={"error": "worker 1 did not write a checkpoint"}))
