"""Verdicts on whole contributions from their sketches: direction, replays, missing sketches;
the same whatever the order, and nothing with the rules off."""

from __future__ import annotations

import itertools

import torch

from diloco.comm import sketch
from diloco.comm.robust import ScreeningRules, screen
from diloco.comm.verdicts import REPEAT_COSINE, ROUNDS_KEPT, SketchHistory, SketchVerdicts, judge


def _honest(n: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(20_000, generator=generator)
    return [common + 0.7 * torch.randn(20_000, generator=generator) for _ in range(n)]


def _sketches(vectors) -> dict:
    return {f"w{i}": sketch.decode(sketch.encode(sketch.sketch_of([v]))) for i, v in enumerate(vectors)}


def test_a_sign_flip_is_left_out_whatever_the_order_and_honest_ones_are_kept():
    honest = _honest(3)
    vectors = [*honest, -honest[0]]
    sketches = list(_sketches(vectors).items())
    for order in itertools.permutations(range(4)):
        left_out = judge(dict(sketches[i] for i in order), 0.0, round_index=0).left_out
        assert list(left_out) == ["w3"], left_out
        assert "does not point the others' way" in left_out["w3"]
    assert judge(dict(sketches), -1.0, round_index=0) == SketchVerdicts()  # off


def test_two_cannot_tell_and_half_against_is_no_majority():
    honest = _honest(2)
    assert judge(_sketches([honest[0], -honest[1]]), 0.0, round_index=0) == SketchVerdicts()
    assert judge(_sketches([*honest, -honest[0], -honest[1]]), 0.0, round_index=0) == SketchVerdicts()


def test_a_replay_of_an_earlier_round_is_told_apart_by_the_history_and_a_new_honest_round_is_not():
    history = SketchHistory()
    first = _sketches(_honest(4, seed=0))
    assert judge(first, 0.0, round_index=0, history=history) == SketchVerdicts()
    second = _sketches(_honest(4, seed=5))
    assert judge(second, 0.0, round_index=1, history=history) == SketchVerdicts()
    replayed = dict(_sketches(_honest(4, seed=9)), w3=first["w1"])  # someone's round-1 contribution again
    verdicts = judge(replayed, 0.0, round_index=2, history=history)
    # this peer's own history: left out of its reducer's sums, not refused by every peer
    assert verdicts.left_out == {} and list(verdicts.repeated) == ["w3"]
    assert "repeats a contribution of round 1 (w1's" in verdicts.repeated["w3"]
    # the round judged again (a retry) is not a replay of itself; another fragment's rounds are not either
    assert judge(second, 0.0, round_index=1, history=history) == SketchVerdicts()
    assert judge(first, 0.0, round_index=3, fragment=1, history=history) == SketchVerdicts()
    # a peer that did not see round 1 keeps it; and when half or more repeat, nobody is told apart
    assert judge(replayed, 0.0, round_index=2, history=SketchHistory()) == SketchVerdicts()
    assert judge(first, 0.0, round_index=4, history=history) == SketchVerdicts()


def test_a_replay_of_the_rounds_mean_is_told_apart_too():
    history = SketchHistory()
    first = _sketches(_honest(4))
    judge(first, 0.0, round_index=0, history=history)
    mean = torch.stack(list(first.values())).mean(dim=0)
    verdicts = judge(dict(_sketches(_honest(3, seed=4)), w3=mean * 1.5), 0.0, round_index=1, history=history)
    assert list(verdicts.repeated) == ["w3"] and "the round's mean" in verdicts.repeated["w3"]
    assert REPEAT_COSINE > 0.9


def test_the_history_keeps_the_last_rounds_of_each_fragment_only():
    history = SketchHistory()
    judge(_sketches(_honest(3)), 0.0, round_index=0, history=history)
    judge(_sketches(_honest(3)), 0.0, round_index=0, fragment=1, history=history)
    for r in range(1, ROUNDS_KEPT + 1):
        judge(_sketches(_honest(3, seed=r)), 0.0, round_index=r, history=history)
    assert all(past > 0 for past, _, _ in history.earlier(100))
    assert [past for past, _, _ in history.earlier(100, fragment=1)] == [0] * 4  # three and their mean


def test_a_contribution_without_a_usable_sketch_is_left_out_when_sketches_are_judged():
    sketches = dict(_sketches(_honest(3)), w3=None)
    assert judge(sketches, 0.0, round_index=0).left_out == {"w3": "it declared no usable sketch of its contribution"}


def test_screen_judges_the_sketches_of_the_contributions_its_norm_rules_kept():
    honest = _honest(3)
    vectors = [*honest, -honest[1], 100 * honest[2]]
    sketches = _sketches(vectors)
    norms = {who: float(v.norm()) for who, v in zip(sketches, vectors)}
    rules = ScreeningRules(max_norm_ratio=10.0, min_cosine=0.0)
    screening = screen(norms, rules, sketches=sketches)
    assert set(screening.dropped) == {"w3", "w4"} and "median norm" in screening.dropped["w4"]
    assert set(screening.scales) == {"w0", "w1", "w2"} and screening.repeated == {}
    assert screen(norms, ScreeningRules(max_norm_ratio=10.0), sketches=sketches).dropped.keys() == {"w4"}
