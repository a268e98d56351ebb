"""A round's averaging over hivemind (``comm/hivemind/averaging.py``) with hivemind's averager
scripted: a worker that refused the parts of a group counted it in too late stops looking for a
group and retries with the others, as the peers of that broken group do (they know: it refused
their parts), before any state was offered and whatever the others' offers say; a part of that
group refused late does not stop the retry. A client of a run of clients left out of its group
postpones the round, unless the run is a whole round ahead of it: its round then fails, and the
recovery takes the others' state. A worker that came to a round's average after every other live
worker was done with it stops looking for its group; each round's end is announced."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from types import SimpleNamespace

import pytest
import torch

from diloco.comm.base import Outcome
from diloco.comm.bounds import round_limit_s
from diloco.comm.config import CommConfig
from diloco.comm.hivemind.averaging import HivemindAveraging
from diloco.comm.hivemind.group_round import LEFT_BEHIND, round_group_bits
from diloco.comm.hivemind.roster_records import RoundState
from diloco.comm.hivemind.settings import HivemindConfig
from diloco.comm.hivemind.traffic import TrafficCounters
from diloco.compression import NoCompression
from tests.hivemind_fakes import KnownHelpers

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 0.2  # a round that finds no group waits its whole limit (round_limit_s): 0.6 s


class _LateLeaderAverager:
    """hivemind's averager of a worker that a leader counts in a group after it gave up on it: the
    first step finds no group and, meanwhile, refuses that group's parts; a retry finds the peer."""

    def __init__(self, peer_mean: torch.Tensor):
        self.traffic, self.exclusions = TrafficCounters(), SimpleNamespace(excluded_peers=lambda: set())
        self.buffers, self.peer_mean = [torch.zeros_like(peer_mean)], peer_mean
        self.group_bits: list[str] = []
        self.targets: list[int] = []  # the group size each attempt started the all-reduce at
        self.cancelled = 0

    def set_group(self, group_bits: str, *, target_group_size: int, timeout_s: float) -> None:
        self.group_bits.append(group_bits)
        self.targets.append(target_group_size)

    @contextlib.contextmanager
    def tensors_within(self, timeout_s: float):
        yield self.buffers

    def step(self, weight: float, gather: dict, timeout: float, wait: bool):
        refuse = lambda: self.traffic.groups_left_behind(+1)  # noqa: E731 - a part of the late group refused
        if len(self.group_bits) == 1:  # matchmaking alone, while the late group's parts are refused
            return _Control(self, [None], on_result=refuse)
        self.buffers[0].copy_(self.peer_mean)  # the retry's group: us and the peer, found at the second poll
        # meanwhile another sender of the late group is refused: the retry goes on
        return _Control(self, [None, {"us": gather, "peer": dict(gather)}], on_result=refuse)


class _Control:
    """hivemind's StepControl: each poll of ``result`` gives the next of ``outcomes`` (None: not done
    yet), the last one from then on."""

    def __init__(self, averager: _LateLeaderAverager, outcomes: list, *, on_result=lambda: None):
        self.began_allreduce, self._averager = False, averager
        self._outcomes, self._on_result = outcomes, on_result

    def result(self, timeout):
        self._on_result()
        outcome = self._outcomes.pop(0) if len(self._outcomes) > 1 else self._outcomes[0]
        if outcome is None:
            time.sleep(min(timeout, 0.01))
            raise concurrent.futures.TimeoutError
        return outcome

    def cancel(self):
        self._averager.cancelled += 1


def _averaging(
    averager,
    *,
    deadline_s: float,
    matchmaking_s: float = 1.0,
    client_mode: bool = False,
    helpers: int = 0,
    fragments: int = 1,
    expected: int = 2,
    published: bool = False,
    **roster,
) -> HivemindAveraging:
    """A round's averaging over the scripted ``averager`` (the same one for each of ``fragments``);
    ``roster``: what the roster says besides the basics (no stage, nobody missing or gone)."""
    basics = dict(stage=lambda stage: None, model="", group=0, missing=(), others_gone=lambda: False, workers_of=tuple)
    basics.update(worker_index=1, own_entries=dict, live=set(), finished_averaging=lambda fragment, round_index: None)
    hivemind = HivemindConfig(request_timeout_s=0.2, matchmaking_s=matchmaking_s)
    return HivemindAveraging(
        CommConfig(deadline_s=deadline_s, hivemind=hivemind),
        peer=SimpleNamespace(peer_id="us", control_s=1.0, client_mode=client_mode),
        roster=SimpleNamespace(**{**basics, **roster}),
        offers=SimpleNamespace(averaged_in_a_group=lambda round_index: False),
        codec=NoCompression(),
        averagers=[averager] * fragments,
        flats=averager.buffers * fragments,
        plane=None,
        num_workers=2,
        membership=SimpleNamespace(expected_peers=lambda: expected),
        # False: no state offered yet (a first round): a refusal alone says the group broke
        states=SimpleNamespace(published=(0, None) if published else None),
        helpers=KnownHelpers(["helper"] * helpers),
    )


def test_a_worker_that_refused_a_group_counting_it_in_too_late_retries_with_that_groups_peers(caplog):
    mean = torch.full((4,), 2.0)
    averager = _LateLeaderAverager(mean)
    tensors = [torch.zeros(4)]
    result = _averaging(averager, deadline_s=30.0).all_reduce_mean(tensors, 1.0, round_index=6, deadline_s=30.0)
    assert averager.cancelled == 1  # it stopped looking for a group once it had refused one
    assert averager.group_bits == [round_group_bits(6), round_group_bits(6, attempt=1)]
    assert LEFT_BEHIND in caplog.text  # the retry's warning says why
    assert result.ok and result.peers == 2, result
    assert torch.equal(tensors[0], mean)


@pytest.mark.parametrize(
    ("lost", "left_behind", "target"),
    [
        (1, False, 2),  # one member crashed: the retry's group is the 2 survivors
        (1, True, 3),  # the group broke for a member that had left it: it retries too
        (2, False, 3),  # every other member failed us: we were cut off, the others may all retry
    ],
)
def test_a_retry_after_a_member_was_lost_inside_the_all_reduce_starts_once_the_survivors_are_there(
    lost, left_behind, target
):
    # a group of the 3 expected broke inside its all-reduce: ``lost`` members' parts never all came
    # back. The retry waits for the group less those, not for the 3 it would wait the matchmaking
    # window for
    averager = _LateLeaderAverager(torch.full((4,), 2.0))

    def step(weight: float, gather: dict, timeout: float, wait: bool):
        if len(averager.group_bits) == 1:  # the lost members' shares hold our own values
            averager.traffic.add(sent=100, failed_values=2 * lost, lost_reducers=lost)
            if left_behind:
                averager.traffic.groups_left_behind(+1)
            return _Control(averager, [{"us": gather, "a": dict(gather), "b": dict(gather)}])
        averager.buffers[0].copy_(averager.peer_mean)
        return _Control(averager, [{"us": gather, "a": dict(gather)}])

    averager.step = step
    averaging = _averaging(averager, deadline_s=30.0, expected=3, published=True)
    result = averaging.all_reduce_mean([torch.zeros(4)], 1.0, round_index=6, deadline_s=30.0)
    assert averager.group_bits == [round_group_bits(6), round_group_bits(6, attempt=1)]
    assert averager.targets == [3, target]
    assert result.ok and result.peers == 2 and result.expected == 3, result


def test_a_worker_that_refused_no_group_does_not_retry_a_round_that_found_no_group():
    averager = _LateLeaderAverager(torch.ones(4))
    averager.step = lambda **kwargs: _Control(averager, [None])  # no group, nothing refused, until its limit
    averaging = _averaging(averager, deadline_s=DEADLINE_S)
    result = averaging.all_reduce_mean([torch.zeros(4)], 1.0, round_index=6, deadline_s=DEADLINE_S)
    assert not result.ok and averager.group_bits == [round_group_bits(6)]


def _client_averaging(
    done_before: int, done_after: int, *, helpers: int, averaged: tuple = (), postponed: tuple = ()
) -> tuple[HivemindAveraging, list, list]:
    """A client of a run of clients (``helpers`` live) whose round finds no group, and the group keys
    it looked under; the other live worker's record shows ``done_before`` rounds done until the
    client starts looking for a group, ``done_after`` from then on, and once it looks, the
    ``averaged`` and ``postponed`` counts given. Ours shows 6. Also the (fragment, round) we postponed."""
    averager = _LateLeaderAverager(torch.ones(4))
    other = SimpleNamespace(round=done_before, leaving=False, serves_state=False, protocol=RoundState())

    def no_group(**kwargs):
        other.round, other.protocol = done_after, RoundState(averaged=averaged, postponed=postponed)
        return _Control(averager, [None])  # no group until the round's limit

    averager.step = no_group
    own_entries = lambda: {  # noqa: E731
        0: other,
        1: SimpleNamespace(round=6, leaving=False, serves_state=False, protocol=RoundState()),
    }
    ours = []
    averaging = _averaging(
        averager, deadline_s=DEADLINE_S, matchmaking_s=0.8 * DEADLINE_S, client_mode=True, helpers=helpers,
        worker_index=1, no_server_seen=lambda: True, own_entries=own_entries,
        postponed_averaging=lambda fragment, round_index: ours.append((fragment, round_index)),
    )  # fmt: skip
    return averaging, averager.group_bits, ours


@pytest.mark.parametrize(
    ("helpers", "done_before", "done_after", "looked", "postponed"),
    [
        (1, 7, 7, True, True),  # the other may have postponed round 7 too: every client alike
        (1, 8, 8, False, False),  # a round behind: fails at once, the recovery takes the state
        (1, 7, 8, True, False),  # the run went on while it looked for a group
        (0, 8, 8, True, True),  # no helper: nobody averaged, and a state has no way to come
    ],
)
def test_a_client_left_out_postpones_unless_the_run_is_a_round_ahead_with_a_helper(
    helpers, done_before, done_after, looked, postponed
):
    averaging, looked_under, announced = _client_averaging(done_before, done_after, helpers=helpers)
    result = averaging.all_reduce_mean([torch.zeros(4)], 1.0, round_index=6, deadline_s=DEADLINE_S)
    assert not result.ok and (result.outcome is Outcome.POSTPONED) == postponed, result
    assert ("the run is past round 7 without us" in result.error) != postponed, result.error
    assert looked_under == ([round_group_bits(6)] if looked else []), looked_under
    assert announced == ([(0, 6)] if postponed else []), announced


@pytest.mark.parametrize(
    ("averaged", "postponed", "behind"),
    [
        ((7,), (0,), True),  # done with round 7 and did not postpone it: a group formed without us
        ((7,), (6,), True),  # it postponed round 6, not round 7
        ((7,), (7,), False),  # postponed round 7 as we do: every client alike
        ((6,), (0,), False),  # still looking for round 7's group: it may postpone it too
        ((), (), False),  # a peer of another version says nothing: not known
    ],
)
def test_a_client_whose_round_another_did_not_postpone_takes_the_state_instead_of_postponing(
    averaged, postponed, behind
):
    # the other client's record shows round 7 done either way (it counts a postponed round too): at
    # the run's last round nothing tells them apart but what the records say of the average
    averaging, _, _ = _client_averaging(6, 7, helpers=1, averaged=averaged, postponed=postponed)
    result = averaging.all_reduce_mean([torch.zeros(4)], 1.0, round_index=6, deadline_s=DEADLINE_S)
    assert not result.ok and (result.outcome is Outcome.POSTPONED) != behind, result
    assert ("the run is past round 7 without us" in result.error) == behind, result.error


@pytest.mark.parametrize(
    ("fragment", "averaged", "live", "stops"),
    [
        (0, [(4,), (5, 2)], {0, 1, 2}, True),  # every other live worker is done with round 4 of fragment 0
        (0, [(4,), (3,)], {0, 1, 2}, False),  # worker 2 is not: the group may still form with it
        (0, [(4,), ()], {0, 1, 2}, False),  # worker 2 does not say (a peer of another version)
        (0, [(4,), (5,)], {0, 1, 2, 4}, False),  # the read missed worker 4's record, live before
        (1, [(5, 3), (9, 3)], {0, 1, 2}, False),  # done with fragment 0's round 4, not fragment 1's
        (1, [(5, 4), (9, 6)], {0, 1, 2}, True),
    ],
)
def test_a_worker_late_to_a_rounds_average_stops_looking_once_every_other_is_done_with_it(
    fragment, averaged, live, stops
):
    averager = _LateLeaderAverager(torch.ones(4))
    averager.step = lambda **kwargs: _Control(averager, [None])  # no group until the round's limit
    records = {
        i: SimpleNamespace(round=0, leaving=False, protocol=RoundState(averaged=a)) for i, a in zip((0, 2), averaged)
    }
    records[1] = SimpleNamespace(round=0, leaving=False, protocol=RoundState(averaged=(3,)))  # ours
    records[3] = SimpleNamespace(round=0, leaving=True, protocol=RoundState())  # leaving: not waited for
    announced = []
    averaging = _averaging(
        averager,
        deadline_s=DEADLINE_S,
        fragments=2,
        live=live,
        own_entries=lambda: records,
        finished_averaging=lambda fragment, round_index: announced.append((fragment, round_index)),
    )
    started = time.monotonic()
    result = averaging.all_reduce_mean([torch.zeros(4)], 1.0, round_index=3, deadline_s=DEADLINE_S, fragment=fragment)
    assert not result.ok
    assert ("done with this round's average" in result.error) == stops, result.error
    # at its first look at the others, not its limit (round_limit_s: 0.6 s)
    assert (time.monotonic() - started < round_limit_s(DEADLINE_S) / 2) == stops
    assert announced == [(fragment, 3)]  # others looking for us stop in turn
