"""Who is in a run right now: each worker's heartbeat on the DHT, and the group size a round expects.

Every worker keeps a record under ``<run_id>.roster`` (subkey: its worker index) fresh from a
background thread (``Roster``): its round, inner step, whether it is leaving, when it was written,
and records of their own (``roster_records.py``): a few figures for ``diloco status`` (loss,
tokens/s, the last validation loss), its round-protocol state and the digest of its params after
its last round. Every worker reads the others' (``RosterReader``). A record lives
``TTL_HEARTBEATS`` heartbeats unless refreshed (``comm.hivemind.heartbeat_s``: 3 s, so 12 s), so a
worker that crashed or lost its link drops out of the roster by itself; one that leaves cleanly
says so at once.

The group size a round waits for (``expected``) starts from the planned ``worker.count`` and
follows what the roster shows: a planned worker that was seen and is gone (left, crashed, cut
off) is no longer waited for; a worker beyond the plan that joined is. A planned worker that has
not shown up yet is still expected (it may be starting), as in a fixed-size run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from diloco.comm.hivemind.roster_records import (
    ParamsDeclaration,
    RosterEntry,
    RoundCounts,
    RoundState,
    Telemetry,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

HEARTBEAT_S = 3.0  # how often a worker refreshes its record (comm.hivemind.heartbeat_s's default)
TTL_HEARTBEATS = 4  # a record not refreshed for this many heartbeats is gone: the worker crashed or lost its link


class PartialRead(RuntimeError):
    """A roster read that cannot be trusted to show who is live."""


class RosterReader:
    """A view of the run's roster records: who is live, who was seen and who left, as of the last
    read. ``dht_call(fn)`` runs ``fn(dht)``, a DHT request made with ``return_future=True``, and
    waits a bounded time for its answer (``peer.bounded_dht_call``). ``worker_index``: this
    worker's (-1: a reader that is no worker, as ``diloco status``'s)."""

    def __init__(
        self,
        dht_call,
        *,
        run_id: str,
        worker_index: int,
        planned: int,
        ttl_s: float = TTL_HEARTBEATS * HEARTBEAT_S,
        clock=None,
    ):
        self._dht_call, self.key = dht_call, f"{run_id}.roster"
        self.worker_index, self.planned, self.ttl_s = worker_index, planned, ttl_s
        self._addresses: dict[int, tuple[str, ...]] = {}  # where each worker seen was last announced
        self._peers: dict[int, str] = {}  # each worker's peer id, as last announced
        self._live: set[int] = set()  # the live workers at the last read
        self._seen: set[int] = set()
        self._left: set[int] = set()  # workers seen leaving cleanly (their records expire after that)
        self._servers_seen: set[int] = set()  # workers seen serving their state (not in client mode)
        self._clock = clock or time.monotonic
        self._last_seen: dict[int, float] = {}  # when each other worker's record was last read, by our clock

    def own_entries(self) -> dict[int, RosterEntry]:
        """``entries()``, checked to hold this worker's own record; ``PartialRead`` when it does not."""
        entries = self.entries()
        if self.worker_index >= 0 and self.worker_index not in entries:
            raise PartialRead("the roster read did not find this worker's own record")
        return entries

    def entries(self) -> dict[int, RosterEntry]:
        """The workers whose records are fresh, by index (this worker included)."""
        found = self._dht_call(lambda dht: dht.get(self.key, latest=True, return_future=True))
        entries = {}
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                value = getattr(item, "value", None)
                if isinstance(subkey, int) and isinstance(value, dict):
                    entries[subkey] = decode(subkey, value)
        return entries

    def expected(self) -> int:
        """Workers a round should wait for: the planned ones not seen gone, plus live ones beyond the plan."""
        live, leaving = self._refresh()
        gone = (self._seen - live) | leaving
        planned = [i for i in range(self.planned) if i not in gone]
        return len(planned) + len([i for i in live if i >= self.planned])

    def others_gone(self) -> bool:
        """Whether no other worker this one has seen is in the run any more, and none is live now:
        each left cleanly, or its record has been missing from the roster for ``ttl_s`` more seconds
        after it expired (killed, crashed, cut off for good: about ``2 * ttl_s`` since its last
        heartbeat, so that a heartbeat late under load is not taken for a crash). Rounds are then
        taken alone at once; a worker that comes back is live again and rounds average in groups."""
        live, _ = self._refresh()
        others_seen = self._seen - {self.worker_index}
        if not others_seen or live != {self.worker_index}:
            return False
        now = self._clock()
        return all(now - self._last_seen.get(i, now) >= self.ttl_s for i in self.missing)

    @property
    def live(self) -> set[int]:
        """The workers live at the last read of the records (this one included)."""
        return set(self._live)

    @property
    def missing(self) -> set[int]:
        """The workers seen in the run that were not live at the last read, and did not leave: crashed,
        or cut off from us (a split run: they may train on apart)."""
        return self._seen - self._live - self._left - {self.worker_index}

    def addresses_of(self, index: int) -> tuple[str, ...]:
        """Where worker ``index`` announced its peer when last seen (empty: a client, or never seen)."""
        return self._addresses.get(index, ())

    def workers_of(self, peers: set[str]) -> tuple[int, ...]:
        """The workers whose last announced peer id (or addresses) is one of ``peers``."""
        announced = {**{i: peer_of(a) for i, a in dict(self._addresses).items()}, **dict(self._peers)}
        return tuple(sorted(i for i, peer in announced.items() if peer in peers))

    def no_server_seen(self) -> bool:
        """Whether no other worker that serves its state has been live since this one started,
        save those that left cleanly: nobody in the run could have reduced a part for a client."""
        return not (self._servers_seen - self._left - {self.worker_index})

    def serves_alone(self) -> bool:
        """Whether this worker is the only one of the run serving its state: every other live one is
        a client, every other that served has left cleanly (one missing without leaving may train
        on apart, with a state of its own), and every planned worker has been seen (one not seen yet,
        or not since this worker started, may serve a state of its own)."""
        self._refresh()
        if set(range(self.planned)) - self._seen:
            return False
        return not (self._servers_seen - self._left - {self.worker_index})

    def _refresh(self) -> tuple[set[int], set[int]]:
        """Read the roster: the live workers (this one included) and those leaving now; remember who
        was seen and who left. A read without this worker's own record (a DHT lookup that found only
        part of the records: seen from peers in client mode) says nothing: ``PartialRead``."""
        entries = self.own_entries()
        live = {i for i, entry in entries.items() if not entry.leaving} | {self.worker_index}
        leaving = {i for i, entry in entries.items() if entry.leaving}
        self._live = live  # before _seen: a worker seen for the first time is never missing
        self._seen |= live
        self._servers_seen |= {i for i in live if i in entries and entries[i].serves_state}
        for index in sorted(leaving - self._left - {self.worker_index}):
            logger.info("worker %d left the run", index)
        self._left |= leaving
        self._left -= live  # one that left and is back (the same index, restarted) is live again
        now = self._clock()
        self._last_seen.update((i, now) for i in live if i != self.worker_index)
        self._addresses.update((i, entries[i].addresses) for i in live if i in entries and entries[i].addresses)
        self._peers.update((i, entries[i].peer) for i in live if i in entries and entries[i].peer)
        return live, leaving


class Roster(RosterReader):
    """This worker's heartbeat (its record, refreshed from a thread of its own), and its view of the
    others (``RosterReader``)."""

    def __init__(
        self,
        dht_call,
        *,
        run_id: str,
        worker_index: int,
        planned: int,
        slots: int = 0,
        heartbeat_s: float = HEARTBEAT_S,
        serves_state: bool = True,
        addresses: Sequence[str] = (),
        peer_id: str = "",
        layout: Sequence[Sequence[Sequence[int]]] = (),
        chores=(),
        clock=None,
    ):
        ttl_s = TTL_HEARTBEATS * heartbeat_s
        super().__init__(dht_call, run_id=run_id, worker_index=worker_index, planned=planned, ttl_s=ttl_s, clock=clock)
        self.heartbeat_s = heartbeat_s
        self.slots = slots or planned
        self.serves_state = serves_state
        self.chores = list(chores)  # also called once a heartbeat, on the heartbeat's thread
        self._round, self._step, self._leaving, self._stats = 0, 0, False, {}
        self._params: ParamsDeclaration | None = None  # the digest after our last round, once declared
        self._phase: tuple[str, float] = ("", 0.0)
        self._stage: str | None = None  # a round's stage, from the transport: matchmaking or averaging
        self.run: dict = {}  # the settings every worker of the run must share, once announced
        self.addresses = list(addresses)  # where our peer is dialled, announced for redial.py (none for a client)
        self.peer_id = peer_id  # our peer's id, announced so that others can name the worker of a peer id
        self.layout = [[list(shape) for shape in fragment] for fragment in layout]  # announced for helpers
        self.group = 0  # the group the round in progress waits for, announced for helpers
        self._counts = RoundCounts()  # per fragment, the rounds we are done with and the last we postponed
        self._stop = threading.Event()
        self._wake = threading.Event()  # set: publish now, not at the next heartbeat
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._publish()
        self._thread = threading.Thread(target=self._beat, name="diloco-roster", daemon=True)
        self._thread.start()

    def progress(self, round_index: int, step: int, stats: dict | None = None) -> None:
        """Rounds completed, inner steps done and (when given) the worker's latest figures for
        ``diloco status``, sent with the next heartbeat. ``stats`` is read, never changed: hand over
        a new dict for new figures."""
        self._round, self._step = round_index, step
        if stats is not None:
            self._stats = stats

    def declare_params(self, rounds_done: int, digest: str, *, peers: int) -> None:
        """The digest of the params after round ``rounds_done`` and the workers that round counted,
        sent at once: a worker checking a state it downloaded waits for the others' records to show it."""
        self._params = ParamsDeclaration(rounds_done, digest[:16], peers)
        self._wake.set()

    def finished_averaging(self, fragment: int, round_index: int) -> None:
        """This worker is done with round ``round_index``'s average of ``fragment`` (averaged, failed
        or given up), sent with the next heartbeat: a worker that came late to that round, still
        looking for its group, stops waiting for us (``HivemindAveraging``)."""
        self._counts.done(fragment, round_index)
        self._wake.set()  # at once: a worker that came late stops waiting for us a heartbeat sooner

    def postponed_averaging(self, fragment: int, round_index: int) -> None:
        """This worker postponed round ``round_index``'s average of ``fragment`` (no group with a
        helper, in a run of clients). Called before ``finished_averaging``, which announces both."""
        self._counts.postponed(fragment, round_index)

    @property
    def model(self) -> str:
        """The digest of the worker's params after its last round, as it last declared it
        (``declare_params``); empty before its first round."""
        return self._params.digest if self._params is not None else ""

    @property
    def rounds_done(self) -> int:
        """The rounds this worker has completed, as it last reported (``progress``)."""
        return self._round

    def phase(self, name: str, since: float) -> None:
        """What the worker is doing and since when, sent with the next heartbeat."""
        self._phase = (name, since)

    def stage(self, stage: str | None) -> None:
        """Where a round in progress stands (matchmaking, averaging), or None when none is: it names
        the worker's phase while the worker is in a round. A round that starts looking for its
        group is told at once (helpers join the group when they read it: ``helper.py``)."""
        woken, self._stage = stage == "matchmaking" and self._stage != stage, stage
        if woken:
            self._wake.set()

    def leave(self) -> None:
        """Tell the others at once that this worker is gone, so that no round waits for it."""
        self._leaving = True
        self._stop.set()
        self._wake.set()
        self._publish()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s * 2)

    def _beat(self) -> None:
        chores_due = time.monotonic() + self.heartbeat_s
        while True:
            self._wake.wait(max(0.0, chores_due - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            self._publish()
            if time.monotonic() < chores_due:  # an extra record, between heartbeats: the chores keep their pace
                continue
            chores_due = time.monotonic() + self.heartbeat_s
            for chore in self.chores:
                try:
                    chore()
                except Exception:  # a chore of the heartbeat's must not stop it
                    logger.debug("heartbeat chore failed", exc_info=True)

    def _publish(self) -> None:
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        value = encode(self._record(now))
        expiration = now + self.ttl_s
        try:
            self._dht_call(
                lambda dht: dht.store(
                    self.key, subkey=self.worker_index, value=value, expiration_time=expiration, return_future=True
                )
            )
        except Exception:  # a missed heartbeat is not an error; the next one may go through
            logger.debug("roster heartbeat failed", exc_info=True)

    def _record(self, now: float) -> RosterEntry:
        """This worker's record as of ``now`` (DHT time). While the worker averages, its round's stage
        (from the transport) names its phase."""
        phase, since = self._phase
        averaged, postponed = self._counts.counts()
        stage = self._stage if phase == "averaging" and self._stage is not None else ""
        layout = tuple(tuple(tuple(shape) for shape in fragment) for fragment in self.layout)
        return RosterEntry(
            self.worker_index,
            self._round,
            self._step,
            self._leaving,
            self.run,
            written_at=now,
            serves_state=self.serves_state,
            planned=self.planned,
            slots=self.slots,
            addresses=tuple(self.addresses),
            peer=self.peer_id,
            shows=Telemetry(self._stats, stage or phase, since),
            protocol=RoundState(layout, self.group, averaged, postponed, stage),
            params=self._params,
        )


def peer_of(addresses) -> str:
    """The peer id in a worker's announced multiaddrs (``.../p2p/<id>``); "" when it announced none."""
    for address in addresses:
        if "/p2p/" in address:
            return address.rsplit("/p2p/", 1)[1].split("/", 1)[0]
    return ""


def worker_names(indices) -> str:
    """``worker 2`` or ``workers 2, 3``, in order."""
    return f"worker{'s' * (len(indices) != 1)} {', '.join(map(str, sorted(indices)))}"


def free_slot(entries: dict[int, RosterEntry], slots: int) -> int | None:
    """The lowest worker index in ``range(slots)`` that no live worker holds; None when all are taken."""
    taken = {i for i, entry in entries.items() if not entry.leaving}
    return next((i for i in range(slots) if i not in taken), None)


def live_counts(roster: Roster) -> tuple[int, int] | None:
    """(live workers besides ``roster``'s own that serve their state, live workers in all, clients
    and ours included), from one read of the records: the offers a worker looking for a state waits
    for (a planned worker never seen is not waited for). None when the DHT did not answer, or found
    only part of the records."""
    try:
        entries = roster.own_entries()
    except Exception:
        logger.debug("roster read failed", exc_info=True)
        return None
    live = [(i, e) for i, e in entries.items() if not e.leaving]
    return sum(1 for i, e in live if i != roster.worker_index and e.serves_state), len(live)


def live_peer_ids(roster: Roster) -> set[str] | None:
    """The peer ids of the live workers (ours included), from one read of the records; None when the
    DHT did not answer, or a live worker's record names no peer (one that does not say)."""
    try:
        entries = roster.own_entries()
    except Exception:
        logger.debug("roster read failed", exc_info=True)
        return None
    peers = {e.peer for e in entries.values() if not e.leaving}
    return None if "" in peers else peers
