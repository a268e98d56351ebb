"""The run's other workers as one worker's roster records tell them, and what a client does with a
round that found no group.

A round reads the others' records (``roster_records.py``: the rounds each has done, which rounds'
averages it is done with, which it postponed) to know when waiting for a group is pointless: every
other worker is gone, or done with this round's average (``group_round.py``). A client of a run of
clients (no live worker serves its state, none has since it started) cannot be dialled, so its
round's group forms only through a helper: left out of it, the client postpones the round as every
client alike does, unless the run went on without it: then its round fails, and the recovery takes
the others' state through a helper.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from diloco.comm.base import Outcome, SyncResult
from diloco.comm.hivemind.helper_record import RunHelpers
from diloco.comm.hivemind.peer import Peer
from diloco.comm.hivemind.roster import Roster, live_counts
from diloco.comm.hivemind.roster_records import RosterEntry

logger = logging.getLogger(__name__)


class OtherWorkers:
    """The other workers of ``roster``'s run, each question answered from one read of the records
    (``group_round.Others``: ``others_gone`` and ``others_done``)."""

    def __init__(self, roster: Roster):
        self._roster = roster

    def others_gone(self) -> bool:
        """Whether no other worker is left in the run (``Roster.others_gone``); not when the DHT did not tell."""
        try:
            return self._roster.others_gone()
        except Exception:  # the DHT did not tell (no answer, part of the records, a dead daemon)
            logger.debug("roster read failed", exc_info=True)
            return False

    def others_done(self, fragment: int, round_index: int) -> bool:
        """Whether every other live worker's record says it is done with round ``round_index``'s
        average of ``fragment``: no group of that round will form any more."""
        read = self._records()
        if read is None:
            return False
        entries, others = read
        if self._roster.live - set(entries):  # a read that missed a live worker's record: it may be looking
            return False
        return bool(others) and all(_done_with(e, fragment, round_index) for e in others)

    def run_is_ahead(self, round_index: int) -> bool:
        """Whether a live worker's record shows a round after round ``round_index`` completed (``_past``)."""
        return self._any_other(lambda entry: _past(entry, round_index))

    def others_went_on(self, fragment: int, round_index: int) -> bool:
        """Whether a live worker's record shows a later round done, or says it is done with round
        ``round_index``'s average of ``fragment`` without having postponed it (it averaged, or its
        round failed: either way it took an outer step that a postponed round would not), so that
        postponing ours would leave our params apart from its (at the run's last round for good).
        A record that does not say: not known."""
        return self._any_other(
            lambda entry: (
                _past(entry, round_index)
                or (_done_with(entry, fragment, round_index) and _postponed_before(entry, fragment, round_index))
            )
        )

    def clients_only(self) -> bool:
        """Whether no live worker serves its state, nor has any since we started: a run of clients."""
        live = live_counts(self._roster)
        return live is not None and live[0] == 0 and self._roster.no_server_seen()

    def _records(self) -> tuple[dict[int, RosterEntry], list[RosterEntry]] | None:
        """One read of the roster: every live worker's record by index (ours included), and the
        other workers' that are not leaving; None when the DHT did not answer, or found part of them."""
        try:
            entries = self._roster.own_entries()
        except Exception:
            logger.debug("roster read failed", exc_info=True)
            return None
        return entries, [e for i, e in entries.items() if i != self._roster.worker_index and not e.leaving]

    def _any_other(self, holds: Callable[[RosterEntry], bool]) -> bool:
        """Whether, in one roster read, ``holds`` for the record of another live worker that is not leaving."""
        read = self._records()
        return read is not None and any(holds(entry) for entry in read[1])


class ClientRounds:
    """What a client does with a round no group formed for, in a run of clients (``others``) with
    ``helpers`` live or not; ``peer``: ours, which tells whether this worker is a client at all."""

    def __init__(self, roster: Roster, others: OtherWorkers, helpers: RunHelpers, peer: Peer):
        self._roster, self._others, self._helpers, self._peer = roster, others, helpers, peer
        self._said_unreachable_run = False

    def behind(self, round_index: int, weight: float) -> SyncResult | None:
        """The round failed at once, before looking for a group, for a client a round behind the
        others (it joined, or came back, as a round ended) with a helper live: no group of this
        round will form; its recovery takes their state through a helper with the whole deadline
        left (postponed, it would look for each round's group a round behind theirs for good).
        None otherwise."""
        if (
            self._peer.client_mode
            and self._others.run_is_ahead(round_index)
            and self._others.clients_only()
            and self._helpers.count()
        ):
            return SyncResult(Outcome.FAILED, 1, weight, error=_behind(round_index))
        return None

    def left_out(self, result: SyncResult, *, fragment: int, round_index: int) -> SyncResult:
        """``result`` of a round that found no group, for a client of a run of clients: failed when
        the run went on while it looked (a helper then has the others' state), else postponed as
        every client alike postpones it; any other ``result`` as it is."""
        if result.averaged or result.group or not self._peer.client_mode or not self._others.clients_only():
            return result
        helpers = self._helpers.count()
        if helpers and self._others.others_went_on(fragment, round_index):  # while we looked for a group
            return dataclasses.replace(result, error=_behind(round_index))
        # a client, no group, and no worker that could reduce: the clients in the same place (a
        # helper, if any, is gone or late, or its group formed without us) all postpone alike;
        # without a helper nobody can have averaged, a client a round behind included
        if not self._said_unreachable_run and not helpers:
            self._said_unreachable_run = True
            logger.warning(
                "no worker of the run that can be dialled is live: clients alone cannot average; "
                "forward a port and set comm.hivemind.announce_host, or start one worker on a public address, "
                "or a helper (diloco helper) there"
            )
        if helpers:  # the helper is gone or late: the others find no group either
            error = "no group with a helper found: the round is postponed"
        else:
            error = "no worker or helper that can be dialled is live: the round is postponed"
        self._roster.postponed_averaging(fragment, round_index)
        return dataclasses.replace(result, outcome=Outcome.POSTPONED, error=error)


def _behind(round_index: int) -> str:
    return f"the run is past round {round_index + 1} without us"


def _done_with(entry: RosterEntry, fragment: int, round_index: int) -> bool:
    """Whether a worker's record says it is done with round ``round_index``'s average of ``fragment``
    (averaged, failed or given up); a record that does not say: not."""
    return fragment < len(entry.protocol.averaged) and entry.protocol.averaged[fragment] > round_index


def _postponed_before(entry: RosterEntry, fragment: int, round_index: int) -> bool:
    """Whether a worker's record says the last round of ``fragment`` it postponed came before round
    ``round_index``; a record that does not say: not."""
    return fragment < len(entry.protocol.postponed) and entry.protocol.postponed[fragment] <= round_index


def _past(entry: RosterEntry, round_index: int) -> bool:
    """Whether a worker's record shows a round after round ``round_index`` completed (a record
    counts the rounds completed; one at this round may have postponed it as we would)."""
    return entry.round > round_index + 1
