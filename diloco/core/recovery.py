"""Recovery: what a worker does when its global state may not be the run's.

After a round that failed (the worker applied its own pseudo-gradient), was partial, or ran in
a smaller group than expected (hivemind's matchmaking can split a round), the worker offers its
state to its peers and takes the state of one that ranks higher, so that it ends with the
others' params instead of drifting. ``Recovery`` holds that protocol for every case:

    after_round       after a blocking round's outer step (``BlockingRounds`` in worker/sync_modes.py):
                      may take the state of a later round, and says which, so that the worker skips to it
    after_average     after an overlapped average of one fragment (core/overlap.py): the same, of
                      that round only (the schedule of averages in flight cannot skip rounds)
    note_average      after an overlapped average of one of several fragments: a peer's state would
                      mix fragments at other points of their schedules, so a failed average only
                      marks the worker DRIFTED, and it goes on
    offer_before_end  before a run's last averages (several fragments): "still here", so peers wait
    at_run_end        after them: a DRIFTED worker takes a whole state, where every worker applied
                      the same averages
    behind_the_run    before the first round, when live peers are rounds ahead (a newcomer, or a
                      restart from an old checkpoint: worker/joining.py says when, and where to start)

Its input is a ``RoundOutcome`` (the round's ``Outcome``, comm/round_result.py, and how many
share its params) and a ``Finding`` (what it found after the round); its state a ``Standing``,
which ``next_standing`` moves:

    finding        the round (its Outcome)               standing before    after
    TOOK_STATE     any                                   any                SYNCED
    RUN_OF_ONE     CUT_OFF                               any                UNSYNCED
    RUN_OF_ONE     any other                             any                as it was
    NONE_OUTSIDE   CUT_OFF                               any                UNSYNCED
    NONE_OUTSIDE   any other                             any                SYNCED
    NONE_BETTER    a mean (AVERAGED, SPLIT, PARTIAL, ..) SYNCED, DRIFTED    SYNCED (a split round's winner)
    NONE_BETTER    a mean                                UNSYNCED           UNSYNCED
    NONE_BETTER    no mean (FAILED, DROPPED)             any                UNSYNCED
    SOLE_SOURCE    no mean, while a group of several     any                UNSYNCED
                   formed for the round
    SOLE_SOURCE    any other                             any                SYNCED (the others take ours)
    (note_average) no mean, or CUT_OFF, of a fragment    SYNCED             DRIFTED

How good a state is, is a ``StateRank`` (comm/base.py): averaged over more peers first, then the
fingerprint of the params, which makes the groups of a split round agree on one winner. A worker
that needed a state and found none is UNSYNCED: its params may differ from its group's, and
averaging pseudo-gradients with it would not bring them together, so at the next round it ranks
itself below every peer (peers 0, "demoted") and takes its group's state.

Where the rest lives: the transport serves and downloads states (its ``StateExchange``:
``publish_state``, ``fetch_state``, ``sole_state_source`` in comm/base.py; hivemind's in
comm/hivemind/state_exchange.py) and says who is live (its ``Membership``); the worker builds its
``Recovery`` with both once it has a transport (worker/build.py), and runs it after each round
(worker/sync_modes.py for blocking rounds, core/overlap.py for overlapped ones). The outer step applies the
worker's own pseudo-gradient when a round failed (core/outer.py).

A downloaded state is checked before it is taken (``Recovery.check``): its params (and the outer
optimizer's state that comes with them: one digest over both) must be those
a majority of the live workers declared after its round (their roster records carry the digest),
so a key holder that offers other params under a high rank is refused, named in the log, and the
next offer tried.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from diloco.comm.base import (
    Declared,
    Membership,
    Outcome,
    PeerState,
    StateExchange,
    StateRank,
    StateReader,
    StateVerdict,
    SyncResult,
)

logger = logging.getLogger(__name__)

RECORDS_LAG_S = 8.0  # a record shows what its worker did within a heartbeat or two (comm.hivemind.heartbeat_s, 3 s)
FAR_AHEAD_ROUNDS = 10  # a state this many rounds past every record is refused: records lag, not by that much


class Standing(enum.Enum):
    """Whether the worker's global params are those of the run."""

    SYNCED = "synced"  # those of the group it averaged with (or of the peer whose state it took)
    # it needed a peer's state and found none, or took rounds alone while a worker that vanished may
    # train on: its params may differ from the others'; it ranks below every peer until it takes one
    UNSYNCED = "unsynced"
    # several fragments: an average failed for it since it last took a state; it takes one at the run's end
    DRIFTED = "drifted"


class Finding(enum.Enum):
    """What recovery found after a round: the other input of ``next_standing``."""

    RUN_OF_ONE = "run of one"  # no other worker is live: nobody to compare with, nothing looked for
    NONE_OUTSIDE = "none outside"  # everyone averaged, or too few are outside our group to rank higher
    TOOK_STATE = "took state"  # a better peer's state was taken
    NONE_BETTER = "none better"  # looked for a better state; none was served
    SOLE_SOURCE = "sole source"  # none was served, and no other live worker serves states: they take ours


def next_standing(standing: Standing, outcome: RoundOutcome | None, finding: Finding) -> Standing:
    """The standing after a round (the table in this module's docstring); ``outcome`` may be None
    only where a state was taken (``Finding.TOOK_STATE``: before the first round, say)."""
    if finding is Finding.TOOK_STATE:
        return Standing.SYNCED
    if finding in (Finding.RUN_OF_ONE, Finding.NONE_OUTSIDE):
        if outcome.outcome is Outcome.CUT_OFF:  # alone while others may train on: its params may part
            return Standing.UNSYNCED
        return standing if finding is Finding.RUN_OF_ONE else Standing.SYNCED
    if finding is Finding.NONE_BETTER:  # a winner of a split round stays; a failed or unsynced one cannot tell
        return Standing.SYNCED if outcome.averaged and standing is not Standing.UNSYNCED else Standing.UNSYNCED
    # SOLE_SOURCE: the others take our state, so ours is the run's, unless a group averaged without us
    return Standing.UNSYNCED if _averaged_without_us(outcome) else Standing.SYNCED


def _averaged_without_us(outcome: RoundOutcome) -> bool:
    """A group of several formed for the round, and this worker holds no mean of it."""
    return outcome.grouped and not outcome.averaged


@dataclass(frozen=True)
class RoundOutcome:
    """What a round left this worker with, as recovery reads it: the round's ``Outcome``, and how
    many workers share the params it left."""

    round_index: int
    outcome: Outcome
    peers: int  # workers in that mean; at most 1 when not averaged (0: the group dropped ours)
    group: int  # the group's size, dropped members included, when averaged; 0 = not known
    grouped: bool  # a group of several formed for the round, with this worker or without it

    @property
    def averaged(self) -> bool:
        """It holds its group's mean (whole or partial); else its own pseudo-gradient."""
        return self.outcome.averaged

    @classmethod
    def of(cls, result: SyncResult, round_index: int) -> RoundOutcome:
        # a group that held several models (a split run met again): only the workers of ours share our
        # params, so the round ranks as if they alone had been our group; the other side's offers
        # then decide which model the run keeps (the bigger side's; between sides of one size, the
        # larger fingerprint's), as between the groups of a split round
        side = result.sides[0] if result.sides else None
        return cls(
            round_index,
            result.outcome,
            # a worker whose contribution the group dropped ranks its state below every other (peers 0)
            peers=min(side or result.peers, result.peers) if result.averaged else min(result.peers, 1),
            group=(side or result.group) if result.averaged else 0,
            grouped=result.group > 1,
        )


class RecoverableState(Protocol):
    """What recovery needs of the worker's global state (``OuterStep``)."""

    def fingerprint(self) -> float: ...

    def declared_digest_of(self, state: dict) -> str: ...

    def offered_state(self) -> StateReader: ...

    def load_state_dict(self, state: dict) -> None: ...


class Recovery:
    """The recovery protocol of one worker's global ``state`` (see the module's docstring)."""

    def __init__(
        self,
        state: RecoverableState,
        states: StateExchange | None = None,
        membership: Membership | None = None,
        *,
        records_lag_s: float = RECORDS_LAG_S,
    ):
        """Recover ``state`` through the transport's ``states`` exchange, asking its ``membership``
        who is live and what they declared (neither given: a transport that exchanges no states,
        where there is never a state to take)."""
        self.state = state
        self.states = states if states is not None else StateExchange()
        self.membership = membership if membership is not None else Membership()
        # how long the others' records may lag what they did, before a state nobody else vouches for is taken
        self.records_lag_s = records_lag_s
        self._unvoted: dict[str, float] = {}  # servers of states nobody else vouched for: since when
        self.standing = Standing.SYNCED
        # several fragments: some average since the last state taken held a group's mean (with
        # others, not alone); a worker that drifted then still carries the others' progress
        self.averaged_with_others = False

    def after_round(self, outcome: RoundOutcome, *, expected_peers: int, timeout_s: float) -> int | None:
        """After a blocking round: take a better state of this round or of a later one. Returns the
        round of the state taken (the worker's params then restart from it), or None."""
        return self._catch_up(outcome, expected_peers=expected_peers, timeout_s=timeout_s, newer=True)

    def after_average(self, outcome: RoundOutcome, *, expected_peers: int, timeout_s: float) -> int | None:
        """After an overlapped average of one fragment: take a better state of that round only."""
        return self._catch_up(outcome, expected_peers=expected_peers, timeout_s=timeout_s, newer=False)

    def note_average(self, outcome: RoundOutcome) -> None:
        """An average of one of several fragments was applied: one that failed for this worker, or
        that it took alone while workers had vanished, leaves it DRIFTED until the run's end."""
        if self.standing is Standing.SYNCED and (not outcome.averaged or outcome.outcome is Outcome.CUT_OFF):
            self.standing = Standing.DRIFTED
        self.averaged_with_others = self.averaged_with_others or (outcome.averaged and outcome.peers > 1)

    def offer_before_end(self, round_index: int) -> None:
        """Before the last averages of a run of several fragments: a peer that ends first then waits
        (the transport's ``finish``) while ours is older, in case we need its state. Ranked lowest (peers
        0): it only says that we are still here, and no peer takes it for an average made without
        it (that needs an offer averaged in a group)."""
        self.states.publish_state(round_index, StateRank(0), self.state.offered_state())

    def at_run_end(
        self,
        last: Sequence[SyncResult],
        *,
        round_index: int,
        expected_peers: int,
        timeout_s: float,
    ) -> int | None:
        """After the last averages of a run of several fragments (``last``, never empty), where every
        worker has applied the same averages: a DRIFTED worker takes the state of a peer that did
        not drift. It ranks as a worker alone (peers 1) if some average held the mean of a group,
        else as a demoted one (peers 0): when an average failed for every worker, one whose every
        contribution was dropped, or that was alone all along, then never wins over those that
        averaged with others. The others offer theirs. Returns the round of the state taken, or None."""
        drifted = self.standing is Standing.DRIFTED
        outcome = RoundOutcome(
            round_index,
            Outcome.FAILED if drifted else Outcome.AVERAGED,
            peers=int(self.averaged_with_others) if drifted else min(r.peers for r in last),
            group=0 if drifted else min(r.group for r in last),
            grouped=self.averaged_with_others,
        )
        return self._catch_up(outcome, expected_peers=expected_peers, timeout_s=timeout_s, newer=True)

    def behind_the_run(self, round_index: int, *, timeout_s: float) -> int | None:
        """Before the first round, with live peers rounds ahead: take the state of one after a round
        later than ``round_index - 1``, the newest first. Returns the round of the state taken, or None."""
        found = self.states.fetch_state(
            round_index - 1, better_than=StateRank(1 << 30), timeout_s=timeout_s, newer=True, check=self.check
        )
        if found is None:
            return None
        self._load(found)
        return found.round

    def _catch_up(self, outcome: RoundOutcome, *, expected_peers: int, timeout_s: float, newer: bool) -> int | None:
        """Offer this state to peers and, if fewer workers than expected averaged, take the state of
        a peer that ranks higher (a bigger group, or the agreed winner between groups of one size),
        or, with ``newer``, of a later round. When the workers outside our group are fewer than our
        peers, none can have averaged over as many: nothing to fetch. ``expected_peers`` is the plan;
        a transport that tracks who is alive says how many are left. The standing then follows
        ``next_standing``."""
        live = self.membership.expected_peers()
        expected = expected_peers if live is None else live
        demoted = self.standing is Standing.UNSYNCED and expected > 1
        ranked_peers = 0 if demoted else outcome.peers
        # the fingerprint only tells apart groups of one size, which a round that everyone
        # averaged in cannot have: hashing every global param each round is skipped then
        rank = StateRank(ranked_peers, self.state.fingerprint() if ranked_peers < expected else 0.0)
        self.states.publish_state(outcome.round_index, rank, self.state.offered_state())  # where states are served
        if not demoted and (
            ranked_peers >= expected or expected - max(ranked_peers, outcome.group) < ranked_peers
        ):  # everyone averaged, or too few are left outside our group to rank higher
            finding = Finding.NONE_OUTSIDE if expected > 1 else Finding.RUN_OF_ONE
            self.standing = next_standing(self.standing, outcome, finding)
            return None
        found = self.states.fetch_state(
            outcome.round_index, better_than=rank, timeout_s=timeout_s, newer=newer, check=self.check
        )
        if found is not None:
            self._load(found)
            self.states.publish_state(found.round, found.rank, self.state.offered_state())  # no longer behind
            logger.warning(
                "round %d: averaged over %d of %d workers; took the state of a peer (%d peers) after round %d",
                outcome.round_index + 1,
                ranked_peers,
                expected,
                found.rank.peers,
                found.round + 1,
            )
            return found.round
        finding = Finding.NONE_BETTER
        # behind, or without a mean, but not when a group averaged without us (the others moved on
        # apart whoever serves states: the table's answer is UNSYNCED, and the roster is not read)
        if (demoted or not outcome.averaged) and not _averaged_without_us(outcome) and self.states.sole_state_source():
            finding = Finding.SOLE_SOURCE
        self.standing = next_standing(self.standing, outcome, finding)
        if demoted and self.standing is Standing.SYNCED:  # offered as unsynced a moment ago: again as what it is
            rank = StateRank(outcome.peers, rank.fingerprint if outcome.peers < expected else 0.0)
            self.states.publish_state(outcome.round_index, rank, self.state.offered_state())
        logger.warning(
            "round %d: averaged over %d of %d workers and no peer did better",
            outcome.round_index + 1,
            ranked_peers,
            expected,
        )
        return None

    def check(self, found: PeerState) -> StateVerdict:
        """What to make of ``found`` before taking it, from what the other live workers declared of
        their params (``Membership.declared_params``; the peer that served it does not vote).

        The voters are the workers that have completed its round, but those whose round counted
        fewer workers than the state's (one that ended it alone, say) when the state claims a group
        no bigger than the live run: such a worker would take that state itself. Its params must be
        those a majority of the voters declared after it: other params, or none, are refused. While
        a voter has yet to declare that round (it is hashing), it cannot be told yet. A state of a round far
        beyond what any worker's record shows (``FAR_AHEAD_ROUNDS``) is refused. It is taken
        unverified where nothing can tell: nobody declares (overlapped runs, sites), no record but
        its server's shows the round completed after ``records_lag_s`` (every other worker is
        looking for a state, or the rounds are quicker than the records), or no digest has a
        majority (a split run's sides meeting again)."""
        declared = {
            i: d for i, d in self.membership.declared_params().items() if not d.peer or d.peer != found.served_by
        }
        if not declared:
            return StateVerdict()
        rounds_done = found.round + 1
        newest = max(d.progress for d in declared.values())
        if rounds_done > newest + FAR_AHEAD_ROUNDS:
            return StateVerdict(refuse=f"it claims round {rounds_done}, and no live worker has completed past {newest}")
        # a group no bigger than the live run: a bigger claim does not silence the smaller groups
        live = self.membership.expected_peers()
        plausible = live is not None and found.rank.peers <= live
        voters = [
            d for d in declared.values() if d.progress >= rounds_done and not (plausible and _outranked(d, found))
        ]
        if not voters:  # the others' records may lag what they did (rounds can be quicker than a heartbeat)
            first_seen = self._unvoted.setdefault(found.served_by, time.monotonic())
            if time.monotonic() - first_seen < self.records_lag_s:
                return StateVerdict(wait=f"no other live worker's record shows round {rounds_done} completed yet")
            return StateVerdict()
        votes: dict[str, int] = {}
        for d in voters:
            if d.rounds_done == rounds_done:
                votes[d.digest] = votes.get(d.digest, 0) + 1
        digest, count = max(votes.items(), key=lambda item: (item[1], item[0]), default=("", 0))
        if 2 * count > len(voters):
            offered = self.state.declared_digest_of(found.state)
            if offered.startswith(digest) and offered:
                return StateVerdict()
            return StateVerdict(
                refuse=f"its params and outer state (digest {offered[:16] or 'none'}) are not those {count} of "
                f"the {len(voters)} live workers that completed round {rounds_done} declared ({digest})"
            )
        pending = sum(d.rounds_done < rounds_done for d in voters)
        if pending:
            return StateVerdict(wait=f"{pending} of the {len(voters)} live workers that completed round "
                                     f"{rounds_done} have not declared their params yet")  # fmt: skip
        return StateVerdict()

    def _load(self, found: PeerState) -> None:
        self.state.load_state_dict(found.state)
        self.standing = next_standing(self.standing, None, Finding.TOOK_STATE)
        self.averaged_with_others = False

    def state_dict(self) -> dict:
        """What an overlapped run of several fragments checkpoints (a blocking worker resumes SYNCED)."""
        return {"drifted": self.standing is not Standing.SYNCED, "averaged_any": self.averaged_with_others}

    def load_state_dict(self, state: dict) -> None:
        # checkpoints from before these were saved: in step
        self.standing = Standing.DRIFTED if state.get("drifted", False) else Standing.SYNCED
        self.averaged_with_others = bool(state.get("averaged_any", False))


def _outranked(declared: Declared, found: PeerState) -> bool:
    """Whether ``declared`` speaks of the round of ``found`` from a smaller group than the one
    ``found`` was averaged in: that worker ranks below the state and would take it itself."""
    return declared.rounds_done == found.round + 1 and 0 < declared.peers < found.rank.peers
