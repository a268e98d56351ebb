"""What a group's declarations tell a worker: whether the group held one model, who contributed."""

from __future__ import annotations

from diloco.comm.hivemind.group_round import Attempt, _declared_model, model_sides
from diloco.comm.hivemind.helper_record import HELPER, contributors


def test_a_group_that_declared_two_models_has_two_sides_ours_first():
    assert model_sides({"a": "m1", "b": "m1", "c": "m1"}, "a") == (3,)  # one model
    assert model_sides({"a": "m1", "b": "m1", "c": "m2", "d": "m2"}, "c") == (2, 2)
    assert model_sides({"a": "m1", "b": "m1", "c": "m1", "d": "m2"}, "d") == (1, 3)
    assert model_sides({"a": "", "b": "m1", "c": "m2"}, "b") == (1, 1)  # a newcomer declares none
    assert model_sides({"a": "", "b": "m1"}, "a") == ()  # nothing to compare ours with


def test_a_declaration_without_a_model_string_declares_none():
    assert _declared_model({"model": "m1", "weight": 1.0}) == "m1"
    assert _declared_model({"weight": 1.0}) == "" and _declared_model({"model": ["m1"]}) == ""
    assert _declared_model(None) == ""


def test_helpers_are_left_out_of_a_groups_contributors_and_counted_in_its_size():
    gathered = {"a": {"weight": 1.0, "norm": 2.0}, "h": {HELPER: True}, "b": {"weight": 1.0}, "x": b"junk"}
    assert list(contributors(gathered)) == ["a", "b", "x"]  # what is unreadable is screened, not skipped
    assert Attempt(0, 0, expected=3, timeout_s=1.0, limit=0.0, helpers=2, fragment=0).group_size == 5
    assert Attempt(0, 0, expected=1, timeout_s=1.0, limit=0.0, fragment=0).group_size == 2  # never a group of one
