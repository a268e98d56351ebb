"""A worker's roster record, as types apart, and how it travels on the DHT (one value per worker).

The record itself (``RosterEntry``) is the worker's membership: who it is in the run (its round and
step, whether it is leaving, the run it runs, the plan it runs by, where it is dialled). It carries
three records of their own, each with its own readers:

- ``Telemetry``: what the worker shows for ``diloco status`` (its latest figures, its phase);
- ``RoundState``: the round protocol's state, which the others' averaging and helpers act on (the
  shapes it averages, the group it waits for, the rounds it is done with or postponed, whether its
  round is looking for its group);
- ``ParamsDeclaration``: the digest of its params after a round, which only the check of a
  downloaded state reads (``HivemindMembership.declared_params``); telemetry never writes it.

Like every record of the run's, the value is signed with the run key where one is set
(``run_key.py``): a peer without the key can write no part of it, a declaration included. A value
of another version of the code reads as "not said", field by field.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from diloco.comm.members import LiveWorker


@dataclass(frozen=True)
class Telemetry:
    """What a worker shows for ``diloco status``."""

    stats: dict = field(default_factory=dict)  # its latest figures: loss, tokens_per_s, val_loss, excluded
    phase: str = ""  # what it is doing (watchdog.py): training, matchmaking, averaging, ...; "" = not said
    phase_since: float = 0.0  # when that began (time.time() of the worker's clock)


@dataclass(frozen=True)
class RoundState:
    """Where a worker stands in the round protocol, for the others' averaging and for helpers."""

    layout: tuple = ()  # the shapes it averages, one tuple per fragment: what a helper reduces (helper.py)
    group: int = 0  # the group its round in progress waits for, helpers included (0 = not said)
    # per fragment, the rounds whose average it is done with (averaged, failed or given up): it
    # looks for no group of those any more (() = not said)
    averaged: tuple[int, ...] = ()
    # per fragment, the last round it postponed (nobody could reduce it for it), plus one (0 = none;
    # () = not said): a client that found no group tells apart others that postponed the round too
    # from others that averaged it without it
    postponed: tuple[int, ...] = ()
    stage: str = ""  # its round's stage while it averages: "matchmaking" (helpers join it then), "averaging"


@dataclass(frozen=True)
class ParamsDeclaration:
    """The digest of a worker's params after a round, and the workers that round counted."""

    rounds_done: int  # the round the digest is of
    digest: str  # the first 16 hex digits of its params' digest
    peers: int = 0  # the workers its round counted (1: it ended that round alone); 0 = not said


@dataclass(frozen=True)
class RosterEntry(LiveWorker):
    """A worker's roster record: its membership, and its records of each kind."""

    written_at: float = 0.0  # DHT time of the record (hivemind.get_dht_time)
    serves_state: bool = True  # False for a peer in client mode: it can fetch a state, never serve one
    planned: int = 0  # the run's worker.count, as this worker runs it (0 = not said)
    slots: int = 0  # the run's data shards: the most workers it can hold (0 = not said)
    addresses: tuple[str, ...] = ()  # where its peer is dialled (none for a client): redial.py
    peer: str = ""  # its peer's id, clients' too ("" from a worker that did not say)
    shows: Telemetry = field(default_factory=Telemetry)
    protocol: RoundState = field(default_factory=RoundState)
    params: ParamsDeclaration | None = None  # None until its first round's digest (or never: not declared)


class RoundCounts:
    """Per fragment, the rounds a worker is done with (averaged, failed or given up) and the last it
    postponed, plus one: what its ``RoundState`` says of them. Fragments end their averages on
    threads of their own."""

    def __init__(self):
        self._done: list[int] = []
        self._postponed: list[int] = []
        self._lock = threading.Lock()

    def done(self, fragment: int, round_index: int) -> None:
        with self._lock:
            _count_up(self._done, fragment, round_index)

    def postponed(self, fragment: int, round_index: int) -> None:
        with self._lock:
            _count_up(self._postponed, fragment, round_index)

    def counts(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(done, postponed), one count per fragment each (0 where none yet)."""
        with self._lock:
            done = tuple(self._done)
            return done, tuple(self._postponed) + (0,) * (len(done) - len(self._postponed))


def _count_up(counts: list[int], fragment: int, round_index: int) -> None:
    """``counts[fragment]`` (one count per fragment, 0 where none yet) raised to past ``round_index``."""
    counts.extend([0] * (fragment + 1 - len(counts)))
    counts[fragment] = max(counts[fragment], round_index + 1)


def encode(entry: RosterEntry) -> dict:
    """``entry`` as the DHT value a worker stores under its index."""
    shows, protocol, params = entry.shows, entry.protocol, entry.params
    value = {
        "round": entry.round,
        "step": entry.step,
        "leaving": entry.leaving,
        "at": entry.written_at,
        "serves": entry.serves_state,
        "planned": entry.planned,
        "slots": entry.slots,
        "run": entry.run,
        "addrs": list(entry.addresses),
        "peer": entry.peer,
        "shows": {"stats": shows.stats, "phase": shows.phase, "since": shows.phase_since},
        "protocol": {
            "layout": [[list(shape) for shape in fragment] for fragment in protocol.layout],
            "group": protocol.group,
            "averaged": list(protocol.averaged),
            "postponed": list(protocol.postponed),
            "stage": protocol.stage,
        },
    }
    if params is not None:
        value["params"] = {"round": params.rounds_done, "digest": params.digest, "peers": params.peers}
    return value


def decode(index: int, value: dict) -> RosterEntry:
    """The record a worker stored under ``index``, from its DHT value."""
    shows, protocol = _section(value, "shows"), _section(value, "protocol")
    stats, run = shows.get("stats"), value.get("run")
    return RosterEntry(
        index,
        int(value.get("round", 0)),
        int(value.get("step", 0)),
        bool(value.get("leaving")),
        run if isinstance(run, dict) else {},
        written_at=float(value.get("at", 0.0)),
        serves_state=bool(value.get("serves", True)),
        planned=int(value.get("planned", 0)),
        slots=int(value.get("slots", 0)),
        addresses=tuple(str(a) for a in value.get("addrs", ()) if isinstance(a, str)),
        peer=str(value.get("peer", "")),
        shows=Telemetry(
            stats if isinstance(stats, dict) else {}, str(shows.get("phase", "")), float(shows.get("since", 0.0))
        ),
        protocol=RoundState(
            _layout(protocol.get("layout")),
            int(protocol.get("group", 0) or 0),
            _counts(protocol.get("averaged")),
            _counts(protocol.get("postponed")),
            str(protocol.get("stage", "")),
        ),
        params=_declaration(value.get("params")),
    )


def _section(value: dict, name: str) -> dict:
    section = value.get(name)
    return section if isinstance(section, dict) else {}


def _declaration(value) -> ParamsDeclaration | None:
    """A record's params declaration; None when it holds none, or not one (a peer of another version)."""
    if not isinstance(value, dict):
        return None
    rounds_done, digest, peers = value.get("round"), value.get("digest"), value.get("peers")
    if type(rounds_done) is not int or not isinstance(digest, str) or not digest:
        return None
    return ParamsDeclaration(rounds_done, digest, peers if type(peers) is int else 0)  # a bool is no count


def _layout(value) -> tuple:
    """A record's ``layout`` as tuples of shapes; ``()`` for anything else (a worker of another version)."""
    try:
        return tuple(tuple(tuple(int(n) for n in shape) for shape in fragment) for fragment in value)
    except (TypeError, ValueError):
        return ()


def _counts(value) -> tuple[int, ...]:
    """A record's per-fragment counts (``()`` when it holds none, or not counts: a peer of another version)."""
    if not isinstance(value, (list, tuple)) or not all(type(count) is int for count in value):
        return ()
    return tuple(value)
