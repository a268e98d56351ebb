"""``diloco bench attacks``: its arms (the attacker, the screens on and off, the run without the
attacker's contributions), the ratios it reports and its table, on a tiny run of one arm."""

from __future__ import annotations

import json

import pytest

from diloco.bench.arms import Job, _run_one
from diloco.bench.attacks import (
    ARMS,
    CLEAN_8,
    WITHOUT,
    _collect,
    excluded_from,
    rounds_with_drops,
    select_arms,
    table,
)
from diloco.cli import UsageError

SMALL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.max_bytes=100000", "logging.eval_batches=2"]


def test_every_attack_is_worker_three_screened_and_the_reference_leaves_worker_three_out():
    by_name = {arm.name: arm for arm in ARMS}
    assert "comm.trust=open" in by_name["minus-9x"].extra and "faults.payload_scale=-9" in by_name["minus-9x"].extra
    assert "faults.worker=3" in by_name["weight-1000x"].extra and "comm.trust=trusted" in by_name["minus-9x-off"].extra
    without = by_name[WITHOUT]
    assert without.workers == 4 and without.overrides[-2:] == ["faults.payload_scale=0", "comm.min_cosine=0.1"]
    assert [arm.name for arm in select_arms(["9x"])] == ["clean", "clean-off", "9x", WITHOUT]
    with pytest.raises(UsageError, match="'10x' is not one of"):
        select_arms(["10x"])


def test_two_attackers_of_eight_are_workers_six_and_seven_and_compared_with_the_clean_run_of_eight(tmp_path):
    league = next(arm for arm in ARMS if arm.name == "minus-9x-2-of-8")
    assert league.workers == 8 and {"faults.worker=6", "faults.count=2", "faults.payload_scale=-9"} <= set(league.extra)
    assert [arm.name for arm in select_arms(["minus-9x-2-of-8"])] == [
        "clean",
        "clean-off",
        WITHOUT,
        CLEAN_8,
        league.name,
    ]
    runs = [
        _run(CLEAN_8, 0, 2.0, 8, tmp_path),
        _run("clean", 0, 1.0, 4, tmp_path),
        _run(league.name, 0, 2.02, 8, tmp_path),
    ]
    arms = _collect(runs)["arms"]
    assert arms[league.name]["ratio_to_clean"] == pytest.approx(1.01) and "ratio_to_without" not in arms[league.name]
    assert "ratio_to_clean" not in arms[CLEAN_8]
    assert f"| {league.name} | 2.0200 | 2.0200 | 1.0100 (/ {CLEAN_8}) | - | 0 | - | <= 1.02 |" in table(_collect(runs))


def _run(name: str, seed: int, loss: float, workers: int, run_dir) -> dict:
    return {
        "arm": name,
        "seed": seed,
        "final_val_loss": loss,
        "bytes_sent": 0,
        "workers": workers,
        "run_dir": str(run_dir),
    }


def test_the_ratios_are_to_the_clean_run_and_the_honest_workers_and_drops_are_counted(tmp_path):
    dropped = tmp_path / "dropped"
    dropped.mkdir()
    rounds = [{"event": "round", "round": r, "peers": 3 if r > 1 else 4} for r in (1, 2, 3)]
    rounds[2]["excluded"] = [3]
    (dropped / "worker-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    assert rounds_with_drops(dropped, 4) == (2, 3) and rounds_with_drops(dropped, 3) == (0, 3)
    runs = [
        _run("clean", 0, 2.0, 4, tmp_path / "none"),
        _run("clean-off", 0, 1.99, 4, tmp_path / "none"),
        _run(WITHOUT, 0, 2.05, 4, tmp_path / "none"),
        _run("minus-9x", 0, 2.1, 4, dropped),
    ]
    results = _collect(runs)
    arms = results["arms"]
    assert arms["clean"]["ratio_to_clean"] == pytest.approx(2.0 / 1.99) and "ratio_to_without" not in arms["clean"]
    assert arms["minus-9x"]["ratio_to_clean"] == pytest.approx(1.05)
    assert arms["minus-9x"]["ratio_to_without"] == pytest.approx(2.1 / 2.05)
    assert arms["minus-9x"]["rounds_with_drops"] == [2]
    text = table(results)
    assert excluded_from(dropped) == {3: 3}
    assert "| minus-9x | 2.1000 | 2.1000 | 1.0500 | 1.0244 | 2 | 3 (r3) | <= 1.02 |" in text
    assert "| clean | 2.0000 | 2.0000 | 1.0050 (/ clean-off) | - | 0 | - |" in text


def test_an_arm_of_the_bench_runs_with_its_attacker(tmp_path):
    arm = next(a for a in ARMS if a.name == "minus-9x")
    run = _run_one(Job(arm, 0, "", 4, tmp_path, "cpu", 1, [*SMALL, "outer.sync_every=2"]))
    assert run["workers"] == 4 and rounds_with_drops(run["run_dir"], 4) == (2, 2)  # left out of both rounds
