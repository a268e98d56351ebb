"""The recovery protocol (diloco.core.recovery), scripted: each case hands ``Recovery`` the outcome of
a round and a fake of the transport's state exchange (which states peers serve, how many workers are
live, whether this worker is the only one serving its state), and checks what it offers, what it
asks for, what it takes and where it stands after. The same protocol through the real outer step:
tests/unit/core/test_outer.py and test_overlap.py; through real hivemind peers: tests/integration/."""

from __future__ import annotations

import hashlib

import pytest

from diloco.comm.base import (
    Declared,
    Membership,
    Outcome,
    PeerState,
    StateExchange,
    StateRank,
    StateVerdict,
    SyncResult,
    fingerprint_of,
)
from diloco.core.recovery import Finding, Recovery, RoundOutcome, Standing, next_standing

FAILED = SyncResult(Outcome.FAILED, peers=1, total_weight=1.0, error="nobody came")


class _Params:
    """A worker's global state reduced to one number: what it offers, and what it takes."""

    def __init__(self, value: float):
        self.value = value

    def fingerprint(self) -> float:
        return fingerprint_of(hashlib.sha256(repr(self.value).encode()).digest())

    def offered_state(self):
        return lambda use: use({"value": self.value})

    @staticmethod
    def declared_digest_of(state: dict) -> str:
        return hashlib.sha256(repr(state["value"]).encode()).hexdigest()

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class _Peers(StateExchange, Membership):
    """The transport's state exchange and membership, scripted: a peer serves ``served`` (after the round asked
    about, or after ``served_round``), ranked one above the asker; ``live`` workers are left
    (None: as planned); ``sole``: every other live worker is a client. Records what is published
    ((round, peers)) and asked for ((round, peers ranked above, later rounds too))."""

    def __init__(
        self, served: float | None = None, *, served_round: int | None = None, live=None, sole=False, declared=None
    ):
        self.served, self.served_round, self.live, self.sole = served, served_round, live, sole
        self.declared = declared or {}  # worker -> (rounds done, params digest) it declared
        self.verdicts: list[StateVerdict] = []
        self.published: list[tuple[int, int]] = []
        self.asked: list[tuple[int, int, bool]] = []

    def publish_state(self, round_index, rank, state):
        self.published.append((round_index, rank.peers))

    def fetch_state(self, round_index, *, better_than, timeout_s, newer=False, check=None):
        self.asked.append((round_index, better_than.peers, newer))
        if self.served is None:
            return None
        taken = round_index if self.served_round is None else self.served_round
        found = PeerState(taken, StateRank(better_than.peers + 1), {"value": self.served}, served_by="S")
        verdict = check(found) if check is not None else StateVerdict()
        self.verdicts.append(verdict)
        return found if verdict.take else None

    def declared_params(self):
        return self.declared

    def sole_state_source(self):
        return self.sole

    def expected_peers(self):
        return self.live


def _after_round(recovery: Recovery, result: SyncResult, round_index: int, *, expected: int):
    outcome = RoundOutcome.of(result, round_index)
    return recovery.after_round(outcome, expected_peers=expected, timeout_s=1.0)


def test_the_outcome_of_a_round_is_read_from_its_result():
    dropped = RoundOutcome.of(SyncResult(Outcome.DROPPED, peers=0, total_weight=1.0, group=3), 4)
    assert dropped == RoundOutcome(4, Outcome.DROPPED, peers=0, group=0, grouped=True) and not dropped.averaged
    alone = RoundOutcome.of(SyncResult(Outcome.FAILED, peers=3, total_weight=1.0, group=1), 0)
    assert alone == RoundOutcome(0, Outcome.FAILED, peers=1, group=0, grouped=False)  # its own, whatever it says
    partial = RoundOutcome.of(SyncResult(Outcome.PARTIAL, peers=2, total_weight=2.0, group=3), 1)
    assert partial == RoundOutcome(1, Outcome.PARTIAL, peers=2, group=3, grouped=True) and partial.averaged


def test_a_failed_round_without_a_better_peer_offers_its_state_asks_once_and_is_unsynced():
    peers = _Peers()
    recovery = Recovery(_Params(1.0), peers, peers)
    assert _after_round(recovery, FAILED, 3, expected=2) is None
    assert peers.published == [(3, 1)] and peers.asked == [(3, 1, True)]
    assert recovery.standing is Standing.UNSYNCED and recovery.state.value == 1.0


def test_a_failed_round_takes_the_state_of_a_peer_from_a_bigger_group_and_offers_it_on():
    peers = _Peers(served=7.0)
    recovery = Recovery(_Params(1.0), peers, peers)
    assert _after_round(recovery, FAILED, 0, expected=4) == 0
    assert recovery.state.value == 7.0 and recovery.standing is Standing.SYNCED
    assert peers.published == [(0, 1), (0, 2)]  # no longer behind: the peers that waited for it may go


def test_a_worker_left_behind_takes_a_later_rounds_state_and_says_which():
    peers = _Peers(served=3.0, served_round=7)
    recovery = Recovery(_Params(1.0), peers, peers)
    assert _after_round(recovery, FAILED, 4, expected=3) == 7
    assert peers.published[-1] == (7, 2) and recovery.state.value == 3.0


def test_a_strict_majority_of_the_round_asks_nobody_for_state():
    majority = SyncResult(Outcome.AVERAGED, peers=3, total_weight=3.0)
    peers = _Peers(served=5.0)
    recovery = Recovery(_Params(1.0), peers, peers)
    assert _after_round(recovery, majority, 2, expected=5) is None
    assert peers.asked == [] and peers.published == [(2, 3)]
    assert _after_round(recovery, majority, 2, expected=6) == 2
    assert peers.asked == [(2, 3, True)]  # 3 others could have averaged as a group of 3


def test_a_group_that_knows_its_size_asks_nobody_when_too_few_are_left_outside_it():
    # 2 averaged in a group of 3 (one dropped) out of 4: the one worker outside cannot rank higher
    peers = _Peers(served=5.0)
    recovery = Recovery(_Params(1.0), peers, peers)
    assert (
        _after_round(recovery, SyncResult(Outcome.AVERAGED, peers=2, total_weight=2.0, group=3), 0, expected=4) is None
    )
    assert peers.asked == []


def test_a_worker_that_found_no_state_takes_its_groups_state_next_round():
    """A failed round whose catch-up found nobody leaves the worker's global params apart from the
    others'. Averaging with them next round would not bring them together, so the worker ranks
    itself below its group (peers 0) and takes a peer's state even though everyone averaged."""
    everyone = SyncResult(Outcome.AVERAGED, peers=3, total_weight=3.0, group=3)
    peers = _Peers()
    recovery = Recovery(_Params(1.0), peers, peers)
    assert _after_round(recovery, FAILED, 0, expected=3) is None
    assert recovery.standing is Standing.UNSYNCED
    peers.served = 3.0
    assert _after_round(recovery, everyone, 1, expected=3) == 1
    assert recovery.standing is Standing.SYNCED and peers.asked == [(0, 1, True), (1, 0, True)]
    assert recovery.state.value == 3.0
    assert _after_round(recovery, everyone, 2, expected=3) is None
    assert len(peers.asked) == 2  # in step with its group again: asks nobody


def test_a_failed_round_leaves_the_only_worker_serving_its_state_in_step():
    """Every other worker is a client: they take this one's state, so this one's is the run's. It
    stays in step (its next offer ranks by its group, which a client stuck looking for a group of
    that round reads as "the others went ahead"), and it asks nobody for a state next round."""
    peers = _Peers(sole=True)
    recovery = Recovery(_Params(1.0), peers, peers)
    assert _after_round(recovery, FAILED, 0, expected=3) is None
    assert recovery.standing is Standing.SYNCED
    _after_round(recovery, SyncResult(Outcome.AVERAGED, peers=2, total_weight=2.0, group=2), 1, expected=3)
    assert peers.published == [(0, 1), (1, 2)]  # ranked by its group, not demoted to 0


def test_the_only_server_unsynced_before_the_clients_showed_up_is_in_step_once_it_averages_with_them():
    """Round 0 failed before the clients were seen (one might have served a state of its own):
    unsynced. Round 1 averaged with them, who took its state: in step, and offered again with its
    group's rank, not the unsynced one it was offered with a moment before."""
    peers = _Peers()
    recovery = Recovery(_Params(1.0), peers, peers)
    _after_round(recovery, FAILED, 0, expected=3)
    assert recovery.standing is Standing.UNSYNCED
    peers.sole = True
    _after_round(recovery, SyncResult(Outcome.AVERAGED, peers=2, total_weight=2.0, group=2), 1, expected=3)
    assert recovery.standing is Standing.SYNCED and peers.published == [(0, 1), (1, 0), (1, 2)]


def test_the_only_server_whose_contribution_its_group_dropped_is_unsynced():
    """The clients averaged without it (its norm was screened out): they moved on apart from it."""
    dropped = SyncResult(Outcome.DROPPED, peers=0, total_weight=1.0, error="the group dropped ours", group=3)
    peers = _Peers(sole=True)
    recovery = Recovery(_Params(1.0), peers, peers)
    _after_round(recovery, dropped, 0, expected=3)
    assert recovery.standing is Standing.UNSYNCED


def test_the_winner_of_a_split_round_finds_nobody_better_and_stays_in_step():
    """Two groups of 2 out of 4: the winning group's members find nobody better. Their round did
    not fail, so they are in step, not unsynced: the next round asks nobody for a state."""
    peers = _Peers()  # no peer state: nobody ranks above the winner
    recovery = Recovery(_Params(1.0), peers, peers)
    assert (
        _after_round(recovery, SyncResult(Outcome.AVERAGED, peers=2, total_weight=2.0, group=2), 0, expected=4) is None
    )
    assert recovery.standing is Standing.SYNCED and peers.asked == [(0, 2, True)]
    _after_round(recovery, SyncResult(Outcome.AVERAGED, peers=4, total_weight=4.0, group=2), 1, expected=4)
    assert peers.asked == [(0, 2, True)]  # everyone averaged in round 1: no download


def test_rounds_taken_alone_while_a_worker_vanished_leave_the_worker_to_take_a_state_when_it_is_back():
    """Its other worker stopped its heartbeats (killed, or cut off, and then maybe training alone
    too): the rounds taken alone meanwhile may part the params from its. When it is back and both
    average in one group, the one whose rounds drifted ranks itself below and takes a state."""
    peers = _Peers(served=3.0, live=1)
    recovery = Recovery(_Params(1.0), peers, peers)
    for round_index in (0, 1):
        alone = SyncResult(Outcome.CUT_OFF, peers=1, total_weight=1.0)
        assert _after_round(recovery, alone, round_index, expected=2) is None
        assert recovery.standing is Standing.UNSYNCED  # nobody live to take a state from
    assert peers.asked == []
    peers.live = 2
    assert _after_round(recovery, SyncResult(Outcome.AVERAGED, peers=2, total_weight=2.0, group=2), 2, expected=2) == 2
    assert recovery.standing is Standing.SYNCED and peers.asked == [(2, 0, True)] and recovery.state.value == 3.0


def test_an_unsynced_worker_left_alone_stays_unsynced_until_someone_is_back():
    peers = _Peers()
    recovery = Recovery(_Params(1.0), peers, peers)
    _after_round(recovery, FAILED, 0, expected=2)
    peers.live = 1  # the other worker left: rounds alone, in step with nobody, fix nothing
    assert _after_round(recovery, SyncResult(Outcome.AVERAGED, peers=1, total_weight=1.0), 1, expected=2) is None
    assert recovery.standing is Standing.UNSYNCED and peers.published[-1] == (1, 1)
    peers.live, peers.served = 2, 3.0
    assert _after_round(recovery, SyncResult(Outcome.AVERAGED, peers=2, total_weight=2.0, group=2), 2, expected=2) == 2
    assert peers.asked[-1] == (2, 0, True)  # demoted: it takes the state of the worker that is back


def test_an_overlapped_average_takes_a_state_of_its_own_round_only():
    peers = _Peers(served=4.0)
    recovery = Recovery(_Params(1.0), peers, peers)
    outcome = RoundOutcome.of(FAILED, 5)
    assert recovery.after_average(outcome, expected_peers=2, timeout_s=1.0) == 5
    assert peers.asked == [(5, 1, False)] and recovery.state.value == 4.0


def _several_fragments(outcomes: list[SyncResult], peers: _Peers | None = None) -> Recovery:
    recovery = Recovery(_Params(1.0), peers, peers)
    for k, result in enumerate(outcomes):
        recovery.note_average(RoundOutcome.of(result, k))
    return recovery


def _at_run_end(recovery: Recovery, last: list[SyncResult]):
    return recovery.at_run_end(last, round_index=5, expected_peers=2, timeout_s=1.0)


def test_several_fragments_take_a_peers_state_at_the_run_end_after_an_average_failed():
    # fragment 0 averaged with the other worker, fragment 1's failed for this one: it goes on drifted
    with_others = SyncResult(Outcome.AVERAGED, peers=2, total_weight=2.0, group=2)
    peers = _Peers(served=4.0)
    recovery = _several_fragments([with_others, FAILED], peers)
    assert recovery.standing is Standing.DRIFTED
    recovery.offer_before_end(3)
    assert _at_run_end(recovery, [with_others, with_others]) == 5
    assert peers.published == [(3, 0), (5, 1), (5, 2)]  # "still here", then ranked as alone, then what it took
    assert peers.asked == [(5, 1, True)]  # its other averages held the others' mean: ranked as alone
    assert recovery.standing is Standing.SYNCED and recovery.state.value == 4.0


def test_several_fragments_none_of_whose_averages_held_rank_below_one_that_averaged_some():
    # an average that failed for every worker leaves them all apart; the one whose every
    # contribution was dropped (peers 0) must not win that run's end over those that averaged some
    peers = _Peers()
    recovery = _several_fragments([FAILED, FAILED], peers)
    assert _at_run_end(recovery, [FAILED, FAILED]) is None
    assert peers.asked == [(5, 0, True)]


def test_several_fragments_without_a_failed_average_offer_their_state_and_take_none():
    with_others = SyncResult(Outcome.AVERAGED, peers=2, total_weight=2.0, group=2)
    peers = _Peers(served=4.0)
    recovery = _several_fragments([with_others, with_others], peers)
    assert _at_run_end(recovery, [with_others, with_others]) is None
    assert peers.asked == [] and peers.published == [(5, 2)] and recovery.standing is Standing.SYNCED


def test_several_fragments_that_find_no_better_state_at_the_end_stay_marked_drifted():
    with_others = SyncResult(Outcome.AVERAGED, peers=2, total_weight=2.0, group=2)
    recovery = _several_fragments([with_others, FAILED], _Peers())
    assert _at_run_end(recovery, [with_others, with_others]) is None
    assert recovery.standing is Standing.UNSYNCED and recovery.state_dict()["drifted"]
    resumed = Recovery(_Params(1.0))
    resumed.load_state_dict(_several_fragments([with_others, FAILED]).state_dict())
    assert resumed.standing is Standing.DRIFTED and resumed.averaged_with_others


def test_a_worker_behind_the_run_takes_the_newest_state_of_a_later_round():
    peers = _Peers(served=9.0, served_round=6)
    recovery = Recovery(_Params(1.0), peers, peers)
    assert recovery.behind_the_run(3, timeout_s=1.0) == 6
    assert peers.asked == [(2, 1 << 30, True)] and recovery.state.value == 9.0
    assert peers.published == []
    nobody = _Peers()
    assert Recovery(_Params(1.0), nobody, nobody).behind_the_run(3, timeout_s=1.0) is None and nobody.asked


def test_a_group_that_held_two_models_ranks_each_side_by_its_own_workers_and_the_smaller_takes_the_bigger():
    # a split run met again: the whole group averaged, but only the workers of our model share our params
    met = SyncResult(Outcome.SPLIT, peers=4, total_weight=4.0, group=4, sides=(1, 3), error="the group held 2 models")
    assert RoundOutcome.of(met, 9) == RoundOutcome(9, Outcome.SPLIT, peers=1, group=1, grouped=True)
    peers = _Peers(served=6.0)
    recovery = Recovery(_Params(1.0), peers, peers)
    assert _after_round(recovery, met, 9, expected=4) == 9  # the lone side takes the other's state
    assert recovery.state.value == 6.0 and recovery.standing is Standing.SYNCED
    bigger = SyncResult(Outcome.SPLIT, peers=4, total_weight=4.0, group=4, sides=(3, 1))
    peers = _Peers(served=6.0)
    recovery = Recovery(_Params(1.0), peers, peers)
    assert _after_round(recovery, bigger, 9, expected=4) is None  # too few outside to rank higher
    assert peers.asked == [] and recovery.state.value == 1.0
    tie = SyncResult(Outcome.SPLIT, peers=4, total_weight=4.0, group=4, sides=(2, 2))
    peers = _Peers()
    recovery = Recovery(_Params(1.0), peers, peers)
    assert _after_round(recovery, tie, 9, expected=4) is None  # the other side ranks lower: none better
    assert peers.asked == [(9, 2, True)] and recovery.standing is Standing.SYNCED


def _digest(value: float) -> str:
    return _Params.declared_digest_of({"value": value})[:16]


def _after_failed_round_4(
    served: float, declared: dict, records_lag_s: float = 0.0, live: int | None = None
) -> tuple[Recovery, _Peers, int | None]:
    """A worker whose round 4 failed looks for a state; peer "S" serves ``served`` (a group of 2);
    the others declared ``declared`` ({worker: Declared}); ``live`` workers (None: as planned)."""
    peers = _Peers(served, declared=declared, live=live)
    recovery = Recovery(_Params(0.0), peers, peers, records_lag_s=records_lag_s)
    taken = _after_round(recovery, SyncResult(Outcome.FAILED, peers=1, total_weight=1.0), 3, expected=4)
    return recovery, peers, taken


def _done(value: float, rounds: int = 4, *, progress: int | None = None, peer: str = "") -> Declared:
    """A worker that completed ``progress`` rounds (default ``rounds``) and declared ``value`` after ``rounds``."""
    return Declared(rounds, _digest(value), rounds if progress is None else progress, peer)


def test_a_state_whose_params_a_majority_of_the_declarations_contradict_is_refused_and_others_are_taken():
    honest, poisoned = 1.0, 666.0
    # the server's own declaration does not vote: two of three others hold the honest params
    declared = {1: _done(honest), 2: _done(honest), 3: _done(poisoned), 4: _done(poisoned, peer="S")}
    recovery, peers, taken = _after_failed_round_4(poisoned, declared)
    assert taken is None and recovery.state.value == 0.0
    assert peers.verdicts == [
        StateVerdict(
            refuse=f"its params and outer state (digest {_digest(poisoned)}) are not those 2 of the 3 live "
            f"workers that completed round 4 declared ({_digest(honest)})"
        )
    ]
    _, peers, taken = _after_failed_round_4(honest, declared)
    assert taken == 3 and peers.verdicts == [StateVerdict()]


def test_a_state_that_nothing_can_tell_is_taken_and_one_the_others_have_yet_to_declare_is_waited_for():
    honest, poisoned = 1.0, 666.0
    # nobody declares (overlapped runs, sites); a split run's two sides at the round; nobody but
    # the server completed the round (the others are looking for a state too): taken unverified
    for declared in (
        {},
        {1: _done(honest), 2: _done(poisoned)},
        {1: _done(honest, 3), 2: _done(honest, 3), 3: _done(poisoned, peer="S")},
    ):
        _, peers, taken = _after_failed_round_4(poisoned, declared)
        assert taken == 3 and peers.verdicts == [StateVerdict()], declared
    # two completed round 4 but one of them is still hashing: it cannot be told yet
    _, peers, taken = _after_failed_round_4(honest, {1: _done(honest), 2: _done(honest, 3, progress=4)})
    expected = "1 of the 2 live workers that completed round 4 have not declared their params yet"
    assert taken is None and peers.verdicts == [StateVerdict(wait=expected)]
    # nobody but the server completed the round: the others' records are given time to show it first
    _, peers, taken = _after_failed_round_4(honest, {1: _done(honest, 3)}, records_lag_s=60.0)
    expected = "no other live worker's record shows round 4 completed yet"
    assert taken is None and peers.verdicts == [StateVerdict(wait=expected)]
    # a round far beyond every record: refused at once (records lag a round or two, not ten)
    far = {1: Declared(1, _digest(honest), -7), 2: Declared(1, _digest(honest), -7)}
    _, peers, taken = _after_failed_round_4(poisoned, far)
    assert taken is None and peers.verdicts == [
        StateVerdict(refuse="it claims round 4, and no live worker has completed past -7")
    ]


def test_a_worker_that_ended_the_round_alone_does_not_vote_against_the_state_of_a_bigger_group():
    pair, alone = 1.0, 7.0
    # the served state was averaged by 2 workers; worker 3 ended that round alone (1 worker): it
    # ranks below the state and would take it itself, so it does not refuse it (it did: the only
    # voter, its lone params were "the run's")
    declared = {1: _done(pair, progress=3), 3: Declared(4, _digest(alone), 4, peers=1)}
    _, peers, taken = _after_failed_round_4(pair, declared, live=4)
    assert taken == 3 and peers.verdicts == [StateVerdict()]
    # one that averaged in a group as big as the state's still votes
    declared = {1: _done(pair, progress=3), 3: Declared(4, _digest(alone), 4, peers=2)}
    _, peers, taken = _after_failed_round_4(pair, declared, live=4)
    assert taken is None and peers.verdicts[0].refuse, peers.verdicts
    # a state claiming a group bigger than the live run silences nobody (a poisoned offer claims 999)
    declared = {1: _done(pair, progress=3), 3: Declared(4, _digest(alone), 4, peers=1)}
    peers = _Peers(pair, declared=declared, live=4)
    recovery = Recovery(_Params(0.0), peers, peers)
    assert recovery.check(PeerState(3, StateRank(999), {"value": pair}, served_by="S")).refuse


def _round(outcome: Outcome, *, grouped: bool = True) -> RoundOutcome:
    return RoundOutcome(3, outcome, peers=1 if not outcome.averaged else 2, group=2, grouped=grouped)


TRANSITIONS = [  # the rows of core/recovery.py's table, in its order: (finding, round, standings before, after)
    (Finding.TOOK_STATE, _round(Outcome.FAILED), list(Standing), Standing.SYNCED),
    (Finding.RUN_OF_ONE, _round(Outcome.CUT_OFF), list(Standing), Standing.UNSYNCED),
    (Finding.RUN_OF_ONE, _round(Outcome.ALONE), list(Standing), None),  # None: as it was
    (Finding.NONE_OUTSIDE, _round(Outcome.CUT_OFF), list(Standing), Standing.UNSYNCED),
    (Finding.NONE_OUTSIDE, _round(Outcome.AVERAGED), list(Standing), Standing.SYNCED),
    (Finding.NONE_BETTER, _round(Outcome.SPLIT), [Standing.SYNCED, Standing.DRIFTED], Standing.SYNCED),
    (Finding.NONE_BETTER, _round(Outcome.PARTIAL), [Standing.UNSYNCED], Standing.UNSYNCED),
    (Finding.NONE_BETTER, _round(Outcome.DROPPED), list(Standing), Standing.UNSYNCED),
    (Finding.SOLE_SOURCE, _round(Outcome.FAILED, grouped=True), list(Standing), Standing.UNSYNCED),
    (Finding.SOLE_SOURCE, _round(Outcome.FAILED, grouped=False), list(Standing), Standing.SYNCED),
]


@pytest.mark.parametrize(("finding", "outcome", "before", "after"), TRANSITIONS)
def test_each_row_of_the_transition_table(finding, outcome, before, after):
    for standing in before:
        assert next_standing(standing, outcome, finding) is (standing if after is None else after), standing


def test_every_outcome_and_finding_has_a_row_of_the_table():
    # a new outcome or finding without a decided row would fall to a default nobody chose
    findings = {row[0] for row in TRANSITIONS}
    assert findings == set(Finding)
    for finding in Finding:
        for outcome in Outcome:
            for standing in Standing:
                assert next_standing(standing, _round(outcome), finding) in set(Standing)


def test_a_fragment_whose_average_failed_or_was_cut_off_leaves_a_synced_worker_drifted():
    for outcome, after in [(Outcome.FAILED, Standing.DRIFTED), (Outcome.CUT_OFF, Standing.DRIFTED),
                           (Outcome.AVERAGED, Standing.SYNCED)]:  # fmt: skip
        recovery = Recovery(_Params(1.0))
        recovery.note_average(_round(outcome))
        assert recovery.standing is after, outcome
