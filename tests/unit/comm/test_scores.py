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
    expected = Standing(left_out=3, in_a_row=3, excluded=scores.excluded()["d"], exclusions=1, term_served=1)
    assert scores.standings["d"] == expected
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


def test_an_excluded_worker_is_readmitted_on_probation_after_its_term_and_excluded_for_twice_as_long_after():
    scores = Scores(exclude_after=2, readmit_after=3)
    bad, good = {"d": "against the others"}, {}
    # excluded in round 2; rounds 3-5 serve its term (its contributions left out before any screening)
    assert _play(scores, [bad, bad, bad, good, bad]) == [[], ["d"], [], [], []]
    assert not scores.is_excluded("d") and scores.standings["d"].in_a_row == 1  # on probation
    assert _play(scores, [bad]) == [["d"]]  # left out once more: excluded again, now for 6 rounds
    assert _play(scores, [good] * 5) == [[]] * 5 and scores.is_excluded("d")
    assert _play(scores, [good, good]) == [[], []] and not scores.is_excluded("d")
    assert scores.standings["d"].in_a_row == 0 and scores.standings["d"].exclusions == 2  # kept: a clean streak
    # rounds it did not send in do not count towards its term
    absent = Scores(exclude_after=1, readmit_after=2)
    absent.record_round(["d"], bad)
    absent.record_round(["a", "b"], good)
    absent.record_round(["a", "b"], good)
    assert absent.is_excluded("d")


def test_readmission_is_logged_once_with_the_next_term(caplog):
    scores = Scores(exclude_after=1, readmit_after=2)
    with caplog.at_level(logging.WARNING, logger="diloco.comm.scores"):
        for index, left_out in enumerate([{"d": "x"}, {}, {}, {}], start=1):
            scores.record_round(WORKERS, left_out, context=f"round {index}: ")
    assert caplog.messages[1:] == [
        "round 3: re-admitted d to the run's means after 2 rounds excluded, on probation: "
        "left out once more, it is excluded for 4 rounds"
    ]


def test_a_negative_exclude_after_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"comm.exclude_after=-1 must be 0 \(never\) or a number of rounds"):
        load_config(None, ["comm.exclude_after=-1"])
    with pytest.raises(ConfigError, match=r"comm.readmit_after=-2 must be 0 \(never\) or a number of rounds"):
        load_config(None, ["comm.readmit_after=-2"])


def _records(run_dir, worker: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"worker-{worker}.jsonl").read_text().splitlines()]


def _simulated_attack(run_dir, *overrides: str) -> list[list[dict]]:
    """Every worker's round records of a simulated run in which worker 3 sends minus 9 x its pseudo-gradient."""
    cfg = load_config(
        None,
        [
            *TINY,
            "comm.backend=simulator",
            "outer.sync_every=5",
            "checkpoint.every_rounds=0",
            f"run.dir={run_dir}",
            "faults.worker=3",
            "faults.bad_payload=scaled",
            "faults.payload_scale=-9",
            "comm.min_cosine=0",
            *overrides,
        ],
    )
    summary = simulate(cfg, workers=4)
    assert summary["params_agree"] and summary["failed_workers"] == [], summary
    return [[r for r in _records(run_dir, worker) if r["event"] == "round"] for worker in range(4)]


@pytest.mark.parametrize("exclude_after", [2, 0])
def test_a_simulated_attacker_is_excluded_after_two_rounds_and_the_records_of_every_worker_say_so(
    tmp_path, exclude_after
):
    for rounds in _simulated_attack(tmp_path, "inner.steps=20", f"comm.exclude_after={exclude_after}"):
        assert [r["peers"] for r in rounds] == [3, 3, 3, 3], rounds  # left out of every round either way
        expected = [[], [3], [3], [3]] if exclude_after else [[]] * 4
        assert [r.get("excluded", []) for r in rounds] == expected, rounds


def test_a_simulated_attacker_readmitted_on_probation_is_excluded_again_at_its_next_round_for_twice_as_long(
    tmp_path,
):
    overrides = ("inner.steps=30", "comm.exclude_after=2", "comm.readmit_after=1")
    for rounds in _simulated_attack(tmp_path, *overrides):
        assert [r["peers"] for r in rounds] == [3] * 6, rounds  # left out of every round, excluded or screened
        # excluded in round 2, back after round 3 (its term: 1 round), excluded again in round 4 for 2 rounds
        assert [r.get("excluded", []) for r in rounds] == [[], [3], [], [3], [3], []], rounds
