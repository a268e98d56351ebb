"""A hivemind worker's part in the run's membership: its roster record (``roster.py``) and what it
reads of the others' (who is live, the group size a round expects, the params they declared), and
the addresses a newcomer joins through."""

from __future__ import annotations

import logging

from diloco.comm.base import Declared, Membership
from diloco.comm.hivemind.peer import Peer
from diloco.comm.hivemind.roster import Roster, peer_of
from diloco.comm.hivemind.roster_records import RosterEntry
from diloco.comm.members import LiveWorker

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

    def declare_params(self, rounds_done: int, digest: str, *, peers: int) -> None:
        self.roster.declare_params(rounds_done, digest, peers=peers)

    def live_workers(self) -> dict[int, LiveWorker]:
        return {i: LiveWorker(e.index, e.round, e.step, e.leaving, e.run) for i, e in self._entries().items()}

    def declared_params(self) -> dict[int, Declared]:
        found = {}
        for index, entry in self._entries().items():
            if index == self.roster.worker_index:  # what we hold is not evidence of what the run holds
                continue
            if (declared := entry.params) is not None:  # the record's declaration, never its telemetry
                peer = peer_of(entry.addresses)
                found[index] = Declared(declared.rounds_done, declared.digest, entry.round, peer, declared.peers)
        return found

    def _entries(self) -> dict[int, RosterEntry]:
        """The live workers' records; none when the DHT did not answer in time."""
        try:
            return self.roster.entries()
        except TimeoutError as error:
            logger.warning("reading the run's roster: %s", error)
            return {}

    def leave(self) -> None:
        self.roster.leave()

    @property
    def addresses(self) -> list[str]:
        return self._peer.addresses
