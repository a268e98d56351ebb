"""The benchmarks' runner: a rerun reuses a finished run (also one moved into another --out, or
made by hand with a named arm's overrides) and restarts one that was cut short from scratch,
without the old run's records; a finished run of another config is left alone."""

from __future__ import annotations

import json

import pytest

from diloco.bench.arms import Arm, Job, _run_one, run_arms
from diloco.cli import UsageError
from tests.conftest import read_records

SMALL = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.max_bytes=100000", "logging.eval_batches=2"]


def test_a_cut_short_run_restarts_clean_and_a_finished_one_is_reused(tmp_path):
    job = Job(Arm("m1-h2", 1, 2), 0, "", 4, tmp_path, "cpu", 1, SMALL)
    stale = tmp_path / "m1-h2-seed0"
    stale.mkdir()
    (stale / "worker-0.jsonl").write_text(json.dumps({"event": "round", "round": 7, "val_loss": 9.0}) + "\n")
    first = _run_one(job)
    assert not first["reused"]
    assert [r["round"] for r in read_records(stale, 0) if r["event"] == "round"] == [1, 2]  # no round 7
    again = _run_one(job)
    assert again["reused"] and again["final_val_loss"] == first["final_val_loss"]
    moved = tmp_path / "elsewhere"  # a finished run moved into another --out is reused there too
    moved.mkdir()
    stale.rename(moved / stale.name)
    assert _run_one(job._replace(out=moved))["reused"]


def test_a_run_made_with_an_arms_overrides_by_hand_is_reused_as_that_arm(tmp_path):
    by_hand = _run_one(Job(Arm("m1-h2", 1, 2), 0, "", 4, tmp_path, "cpu", 1, [*SMALL, "outer.lr=1.0"]))
    (tmp_path / "m1-h2-seed0").rename(tmp_path / "m1-h2-lr1.0-seed0")
    named = _run_one(Job(Arm("m1-h2-lr1.0", 1, 2, ("outer.lr=1.0",)), 0, "", 4, tmp_path, "cpu", 1, SMALL))
    assert named["reused"] and named["final_val_loss"] == by_hand["final_val_loss"]


def _run_arms(out, arm: Arm, *, jobs: int, overrides: list[str]):
    """One arm, seed 0, 4 steps on the CPU."""
    return run_arms(
        "t",
        [arm],
        data_path="",
        steps=4,
        seeds=[0],
        out=out,
        jobs=jobs,
        device="cpu",
        overrides=overrides,
        collect=dict,
    )


def test_a_finished_run_of_another_config_is_refused_not_trained_over(tmp_path):
    _run_one(Job(Arm("m1-h2", 1, 2), 0, "", 4, tmp_path, "cpu", 1, SMALL))
    summary = (tmp_path / "m1-h2-seed0" / "summary.json").read_text()
    with pytest.raises(UsageError, match="holds a finished run of another config"):
        _run_arms(tmp_path, Arm("m1-h2", 1, 2), jobs=1, overrides=[*SMALL, "inner.lr=5e-4"])
    assert (tmp_path / "m1-h2-seed0" / "summary.json").read_text() == summary


def test_hivemind_arms_run_one_at_a_time(tmp_path):
    with pytest.raises(UsageError, match="comm.backend=hivemind runs a process per worker"):
        _run_arms(tmp_path, Arm("m2-h2", 2, 2), jobs=2, overrides=[*SMALL, "comm.backend=hivemind"])
    assert not any(tmp_path.iterdir())  # refused before anything ran
