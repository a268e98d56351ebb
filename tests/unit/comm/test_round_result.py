"""What a round produced (diloco.comm.round_result): the outcomes' meaning for their readers, and
the outcome of several averages taken together (a site's shards, a window of overlapped averages)."""

from __future__ import annotations

import dataclasses

import pytest

from diloco.comm.round_result import Outcome, SyncResult, agreed_outcome


def test_whole_and_averaged_say_what_the_tensors_hold():
    assert {o for o in Outcome if o.whole} == {Outcome.AVERAGED, Outcome.SPLIT, Outcome.ALONE, Outcome.CUT_OFF}
    assert {o for o in Outcome if o.averaged} == {
        Outcome.AVERAGED,
        Outcome.SPLIT,
        Outcome.ALONE,
        Outcome.CUT_OFF,
        Outcome.PARTIAL,
    }
    result = SyncResult(Outcome.PARTIAL, 2, 2.0)
    assert result.averaged and not result.ok
    with pytest.raises(dataclasses.FrozenInstanceError):  # built once, where the round ends
        result.outcome = Outcome.AVERAGED


@pytest.mark.parametrize(
    ("own", "outcomes", "agreed"),
    [
        (Outcome.AVERAGED, [Outcome.AVERAGED, Outcome.SPLIT], Outcome.AVERAGED),  # every shard whole: this rank's own
        (Outcome.AVERAGED, [Outcome.AVERAGED, Outcome.CUT_OFF], Outcome.CUT_OFF),  # one cut off: every rank alike
        (Outcome.AVERAGED, [Outcome.AVERAGED, Outcome.PARTIAL], Outcome.PARTIAL),  # each a common mean, one partial
        (Outcome.AVERAGED, [Outcome.AVERAGED, Outcome.FAILED], Outcome.FAILED),  # one without a mean: the round failed
        (
            Outcome.DROPPED,
            [Outcome.DROPPED, Outcome.AVERAGED],
            Outcome.DROPPED,
        ),  # ours without a mean already: as it is
        (Outcome.POSTPONED, [Outcome.POSTPONED, Outcome.POSTPONED], Outcome.POSTPONED),
    ],
)
def test_several_averages_taken_together_agree_on_one_outcome(own, outcomes, agreed):
    assert agreed_outcome(own, outcomes) is agreed
