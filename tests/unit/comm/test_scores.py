"""Scores across rounds (``comm/scores.py``): the tally, the exclusion after ``comm.exclude_after``
rounds left out in a row and never before, and the simulator and torch.distributed applying it."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from diloco.comm.scores import Scores, Standing
from diloco.config import ConfigError, load_config
from diloco.tools.launcher import simulate
from tests.conftest import TINY

WORKERS = ("a", "b", "c", "d")


def _play(scores: Scores, rounds: list[dict[str, str]], order=WORKERS) -> list[list[str]]:
    return [scores.record_round(order, left_out) for left_out in rounds]


def test_a_worker_left_out_of_exclude_after_rounds_in_a_row_is_excluded_once_and_stays_so():
    scores = Scores(exclude_after=3)
    rounds = [{"d": "far from the median"}] * 3 + [{}]
    assert _play(scores, rounds) == [[], [], ["d"], []]
    assert scores.excluded() == {"d": "left out of 3 rounds in a row, the last: far from the median"}
    assert scores.is_excluded("d") and not scores.is_excluded("a")
    assert scores.standings["d"] == Standing(kept=0, left_out=3, in_a_row=3, excluded=scores.excluded()["d"])
    assert scores.standings["a"].kept == 4  # a round after d's exclusion counts only for the others


def test_an_unlucky_honest_worker_left_out_now_and_then_is_never_excluded():
    scores = Scores(exclude_after=3)
    # left out of 2 rounds in a row at most, then kept: the streak starts again
    rounds = [{"b": "x"}, {"b": "x"}, {}, {"b": "x"}, {"b": "x"}, {}, {"b": "x"}]
    assert _play(scores, rounds) == [[]] * len(rounds)
    assert scores.excluded() == {} and scores.standings["b"].left_out == 5 and scores.standings["b"].kept == 2


def test_every_order_of_arrival_gives_the_same_standings_and_off_excludes_nobody():
    rounds = [{"c": "x", "d": "y"}, {"d": "y"}, {"d": "y"}]
    expected = Scores(exclude_after=3)
    _play(expected, rounds)
    for order in itertools.permutations(WORKERS):
        scores = Scores(exclude_after=3)
        _play(scores, rounds, order)
        assert scores.standings == expected.standings
    never = Scores(exclude_after=0)
    _play(never, rounds * 5)
    assert never.excluded() == {} and never.standings["d"].in_a_row == 15


def test_clipped_rounds_count_as_kept_and_the_exclusion_is_logged_once(caplog):
    scores = Scores(exclude_after=2)
    with caplog.at_level(logging.WARNING, logger="diloco.comm.scores"):
        scores.record_round(WORKERS, {"d": "x"}, clipped={"a"}, context="round 1: ")
        scores.record_round(WORKERS, {"d": "x"}, context="round 2: ")
        scores.record_round(WORKERS, {"d": "x"}, context="round 3: ")
    assert scores.standings["a"] == Standing(kept=3, clipped=1) and scores.is_excluded("d")
    assert caplog.messages == ["round 2: excluded d from the run's means: left out of 2 rounds in a row, the last: x"]


def test_a_negative_exclude_after_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"comm.exclude_after=-1 must be 0 \(never\) or a number of rounds"):
        load_config(None, ["comm.exclude_after=-1"])


def _records(run_dir, worker: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"worker-{worker}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("exclude_after", [2, 0])
def test_a_simulated_attacker_is_excluded_after_two_rounds_and_the_records_of_every_worker_say_so(
    tmp_path, exclude_after
):
    cfg = load_config(
        None,
        [
            *TINY,
            "comm.backend=simulator",
            "inner.steps=20",
            "outer.sync_every=5",
            "checkpoint.every_rounds=0",
            f"run.dir={tmp_path}",
            "faults.worker=3",
            "faults.bad_payload=scaled",
            "faults.payload_scale=-9",
            "comm.min_cosine=0",
            f"comm.exclude_after={exclude_after}",
        ],
    )
    summary = simulate(cfg, workers=4)
    assert summary["params_agree"] and summary["failed_workers"] == [], summary
    for worker in range(4):
        rounds = [r for r in _records(tmp_path, worker) if r["event"] == "round"]
        assert [r["peers"] for r in rounds] == [3, 3, 3, 3], rounds  # left out of every round either way
        expected = [[], [3], [3], [3]] if exclude_after else [[]] * 4
        assert [r.get("excluded", []) for r in rounds] == expected, rounds
