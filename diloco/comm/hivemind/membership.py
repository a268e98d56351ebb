"""A hivemind worker's part in the run's membership: its roster record (``roster.py``) and what it
reads of the others' (who is live, the group size a round expects), and the addresses a newcomer
joins through."""

from __future__ import annotations

import logging

from diloco.comm.base import Declared, Membership
from diloco.comm.hivemind.peer import Peer
from diloco.comm.hivemind.roster import Roster, RosterEntry, peer_of

logger = logging.getLogger(__name__)


class HivemindMembership(Membership):
    """What the worker says of itself and reads of the others, through its ``roster``; a DHT that
    does not answer leaves the plan (``expected_peers``) or nobody (``live_workers``)."""

    def __init__(self, roster: Roster, peer: Peer, *, num_workers: int):
        self.roster, self._peer, self.num_workers = roster, peer, num_workers

    def expected_peers(self) -> int:
        try:
            return self.roster.expected()
        except Exception:  # the DHT did not answer: fall back to the plan
            logger.debug("roster read failed", exc_info=True)
            return self.num_workers

    def report_progress(self, round_index: int, step: int, stats: dict | None = None) -> None:
        self.roster.progress(round_index, step, stats)

    def report_phase(self, phase: str, since: float) -> None:
        self.roster.phase(phase, since)

    def announce_run(self, identity: dict) -> None:
        self.roster.run = dict(identity)

    def live_workers(self) -> dict[int, RosterEntry]:
        try:
            return self.roster.entries()
        except TimeoutError as error:
            logger.warning("reading the run's roster: %s", error)
            return {}

    def declared_params(self) -> dict[int, Declared]:
        found = {}
        for index, entry in self.live_workers().items():
            if index == self.roster.worker_index:  # what we hold is not evidence of what the run holds
                continue
            digest, rounds_done = entry.stats.get("params"), entry.stats.get("params_round")
            if isinstance(digest, str) and digest and isinstance(rounds_done, int):
                peers = entry.stats.get("peers")
                peers = peers if type(peers) is int else 0  # not said, or not a count (a bool is no count)
                found[index] = Declared(rounds_done, digest, entry.round, peer_of(entry.addresses), peers)
        return found

    def leave(self) -> None:
        self.roster.leave()

    @property
    def addresses(self) -> list[str]:
        return self._peer.addresses
