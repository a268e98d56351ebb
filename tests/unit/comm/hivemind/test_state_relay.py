"""A state relayed through a helper in a run of clients (logic only: the DHT, the roster, the offers
and the download are stand-ins handed to the real parts; tests/integration/test_helper.py runs the
real thing in network namespaces)."""

from __future__ import annotations

import asyncio
import io
import time
from types import SimpleNamespace

import pytest
import torch

from diloco.comm.base import StateRank, StateVerdict
from diloco.comm.hivemind import state_exchange
from diloco.comm.hivemind.helper import everyone_past
from diloco.comm.hivemind.roster_records import RosterEntry
from diloco.comm.hivemind.state_exchange import HivemindStateExchange
from diloco.comm.hivemind.state_relay import (
    RelayedStates,
    StateUploader,
    StateWants,
    UploadServer,
    Wanted,
    _messages,
    _received,
)
from tests.hivemind_fakes import KnownHelpers


@pytest.fixture(autouse=True)
def _read_often(monkeypatch):
    """The scripted peers change per read, not per second: the exchange reads them again at once."""
    monkeypatch.setattr(state_exchange, "_READ_AGAIN_S", 0.01)
    monkeypatch.setattr(state_exchange, "_CHECK_AGAIN_S", 0.01)


class _Dht:
    """A DHT of one key's subkeys, the latest expiration winning, as hivemind's keeps them."""

    def __init__(self):
        self.items: dict = {}

    def store(self, key, *, subkey, value, expiration_time, return_future):
        held = self.items.get((key, subkey))
        if held is None or held.expiration_time < expiration_time:
            self.items[(key, subkey)] = SimpleNamespace(value=value, expiration_time=expiration_time)
        return True

    def get(self, key, *, latest, return_future):
        found = {subkey: item for (k, subkey), item in self.items.items() if k == key}
        return SimpleNamespace(value=found) if found else None


def _wants(dht: _Dht, peer: str) -> StateWants:
    return StateWants(lambda fn: fn(dht), "run", peer)


def test_a_request_is_served_by_a_better_state_of_its_round_or_with_newer_by_any_later_one():
    wanted = Wanted(4, StateRank(1, -1.0))
    assert wanted.served_by((4, StateRank(1, 0.2)))  # a state of the same size: any served one wins for a client
    assert wanted.served_by((4, StateRank(2, 0.0)))
    assert not wanted.served_by((4, StateRank(1, -1.0)))
    assert not wanted.served_by((5, StateRank(3, 0.0)))  # a later round only when asked for
    assert Wanted(4, StateRank(1 << 30), newer=True).served_by((5, StateRank(1, 0.0)))
    assert not Wanted(4, StateRank(1 << 30), newer=True).served_by((3, StateRank(3, 0.0)))


def test_a_request_is_read_by_the_other_peers_not_by_the_asker_and_is_gone_once_withdrawn():
    dht = _Dht()
    asker, other = _wants(dht, "asker"), _wants(dht, "other")
    wanted = Wanted(2, StateRank(1, -1.0), newer=True)
    asker.ask(wanted)
    assert other.read() == [wanted] and asker.read() == []
    dht.store("run.state_wanted", subkey="junk", value=["a", 1], expiration_time=1e18, return_future=True)
    assert other.read() == [wanted]  # whatever else a peer put there is no request
    asker.withdraw()
    assert other.read() == []


def test_the_helper_keeps_the_newest_state_then_the_best_ranked_and_offers_each_once():
    relayed = RelayedStates()
    assert relayed.take() is None
    assert relayed.put({"round": 3, "peers": 2, "fingerprint": 0.5}, b"a")
    assert not relayed.put({"round": 3, "peers": 2, "fingerprint": 0.5}, b"again")  # the same offer: kept once
    assert not relayed.put({"round": 2, "peers": 3, "fingerprint": 0.0}, b"older")
    assert relayed.take() == ((3, StateRank(2, 0.5)), {"round": 3, "peers": 2, "fingerprint": 0.5}, b"a")
    assert relayed.take() is None  # offered already
    assert relayed.put({"round": 3, "peers": 3, "fingerprint": 0.0}, b"bigger group")
    assert relayed.take()[2] == b"bigger group"


def test_an_upload_arrives_whole_with_its_metadata():
    blob = bytes(range(256)) * 5000  # spans several streamed parts
    metadata = {"round": 7, "peers": 3, "fingerprint": 0.25}

    async def stream():
        for message in _messages(metadata, bytearray(blob)):
            yield message

    assert asyncio.run(_received(stream())) == (metadata, blob)


def _uploader(wants, *, offers=(), published=None, helpers=("helper",), no_server=True) -> StateUploader:
    return StateUploader(
        None,
        "run",
        wants=wants,
        offers=lambda: list(offers),
        published=lambda: published,
        helpers=KnownHelpers(list(helpers)),
        no_server=lambda: no_server,
        timeout_s=5.0,
    )


def test_a_client_uploads_only_a_state_that_a_peer_asked_for_and_that_no_offer_serves_yet():
    dht = _Dht()
    _wants(dht, "asker").ask(Wanted(2, StateRank(1, -1.0)))
    wants = _wants(dht, "synced")
    ours = (2, StateRank(2, 0.5), lambda use: use({}))
    assert _uploader(wants, published=ours).due() == (ours, "helper")
    assert _uploader(wants, published=None).due() is None  # nothing published yet
    assert _uploader(wants, published=(1, StateRank(3, 0.0), ours[2])).due() is None  # not the round asked for
    assert _uploader(wants, published=ours, offers=[(2, StateRank(2, 0.5))]).due() is None  # the helper has it
    # an offer of a later round does not serve a request for this one: ours still goes up
    assert _uploader(wants, published=ours, offers=[(3, StateRank(3, 0.0))]).due() == (ours, "helper")
    assert _uploader(wants, published=ours, helpers=()).due() is None  # no helper to take it
    assert _uploader(_wants(_Dht(), "synced"), published=ours).due() is None  # nobody asked
    # a run where a worker serves its state: clients do not even read the requests
    assert _uploader(wants, published=ours, no_server=False).due() is None


def test_a_state_goes_up_once_and_to_the_next_helper_when_an_upload_fails():
    dht = _Dht()
    _wants(dht, "asker").ask(Wanted(2, StateRank(1, -1.0)))
    ours = (2, StateRank(2, 0.5), lambda use: use({"global_params": [torch.ones(1)]}))
    sent = []

    class _P2P:
        def __init__(self, fails: bool):
            self.fails = fails

        async def call_protobuf_handler(self, peer, name, messages, output_type):
            sent.append((peer.to_base58(), name, [message async for message in messages]))
            if self.fails:
                raise ConnectionError("the helper is gone")

    uploader = _uploader(_wants(dht, "synced"), published=ours, helpers=("12D3KooWfirst", "12D3KooWsecond"))
    assert uploader.due() == (ours, "12D3KooWfirst")
    with pytest.raises(ConnectionError):
        asyncio.run(uploader._upload(_P2P(fails=True), *uploader.due()))
    assert uploader.due() == (ours, "12D3KooWsecond")
    asyncio.run(uploader._upload(_P2P(fails=False), *uploader.due()))
    assert [(peer, name) for peer, name, _ in sent] == [
        ("12D3KooWfirst", "run.state_upload"),
        ("12D3KooWsecond", "run.state_upload"),
    ]
    assert uploader.due() is None  # up once: the helper's offer may not show yet


def test_a_helper_refuses_an_upload_it_must_not_relay_and_keeps_the_others():
    relayed = RelayedStates()
    refusals = {"stranger": "not a live worker of the run"}
    server = UploadServer(None, "run", relayed, refuses=lambda peer, _round: refusals.get(peer, ""), timeout_s=5.0)

    def upload(peer: str, round_: int):
        async def stream():
            for message in _messages({"round": round_, "peers": 2, "fingerprint": 0.5}, bytearray(b"state")):
                yield message

        context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: peer))
        return asyncio.run(server._take(stream(), context))

    upload("stranger", 9)
    assert relayed.take() is None
    upload("worker", 2)
    assert relayed.take()[0] == (2, StateRank(2, 0.5))


class _ClientsRoster:
    """Three live workers, all clients: nobody serves a state."""

    worker_index = 0

    def own_entries(self):
        return {i: RosterEntry(i, 3, 60, serves_state=False) for i in range(3)}


class _HelperServes:
    """What the helper serves once a client uploaded it."""

    def load_state_from_peers(self, timeout, exclude=()):
        buffer = io.BytesIO()
        torch.save({"global_params": [torch.full((1,), 2.0)]}, buffer)
        metadata = {"round": 2, "peers": 2, "fingerprint": 0.5, "served_by": "helper"}
        return metadata, [torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)]


class _RecordingWants(StateWants):
    def __init__(self, *args):
        super().__init__(*args)
        self.asked: list[Wanted] = []

    def ask(self, wanted: Wanted) -> None:
        self.asked.append(wanted)
        super().ask(wanted)


def test_a_client_that_nobody_can_serve_asks_through_the_helpers_takes_the_relayed_state_and_withdraws():
    dht = _Dht()
    # the helper's offer appears once a client uploaded the state (the third reading)
    readings = iter([[], [], [(2, StateRank(2, 0.5))]])
    latest: list = []

    def read(exclude=()):
        nonlocal latest
        latest = next(readings, latest)
        return list(latest)

    wants = _RecordingWants(lambda fn: fn(dht), "run", "lagging")
    states = HivemindStateExchange(
        server=_HelperServes(),
        offers=SimpleNamespace(read=read),
        roster=_ClientsRoster(),
        num_workers=3,
        client_mode=True,
        linger_s=0.0,
        wants=wants,
        helpers=KnownHelpers(["helper"]),
    )
    found = states.fetch_state(2, better_than=StateRank(1, 0.1), timeout_s=10.0)
    assert found is not None and found.rank == StateRank(2, 0.5) and found.served_by == "helper"
    # asked, as a client: any served state of its size wins over its own
    assert set(wants.asked) == {Wanted(2, StateRank(1, -1.0))}
    assert _wants(dht, "synced").read() == []  # and withdrawn once found


def _client_exchange(wants, *, roster, helpers) -> HivemindStateExchange:
    return HivemindStateExchange(
        server=_HelperServes(),
        offers=SimpleNamespace(read=lambda exclude=(), only=None: []),
        roster=roster,
        num_workers=3,
        client_mode=True,
        linger_s=0.0,
        wants=wants,
        helpers=helpers,
    )


def test_without_a_live_helper_a_client_that_nobody_can_serve_gives_up_at_once_and_asks_nobody():
    dht = _Dht()
    states = _client_exchange(_wants(dht, "lagging"), roster=_ClientsRoster(), helpers=KnownHelpers([]))
    started = time.monotonic()
    assert states.fetch_state(2, better_than=StateRank(1, 0.1), timeout_s=30.0) is None
    assert time.monotonic() - started < 5.0 and not dht.items


class _ServingRoster:
    """Three live workers: this client, another client, and a worker that serves its state."""

    worker_index = 0

    def own_entries(self):
        return {i: RosterEntry(i, 3, 60, serves_state=i == 2) for i in range(3)}


def test_a_client_of_a_run_where_a_worker_serves_states_never_asks_a_helper():
    dht = _Dht()

    class Unread(KnownHelpers):
        def count(self) -> int:
            raise AssertionError("the helpers are read only when nobody serves a state")

    states = _client_exchange(_wants(dht, "lagging"), roster=_ServingRoster(), helpers=Unread([]))
    assert states.fetch_state(2, better_than=StateRank(1, 0.1), timeout_s=3.0) is None
    assert not dht.items


class _LaggingRoster:
    """Three live clients; worker 2 finishes our last round (3) at its ``caught_up_at``-th reading."""

    worker_index = 0
    rounds_done = 3

    def __init__(self, caught_up_at: int):
        self.readings, self.caught_up_at = 0, caught_up_at

    def own_entries(self):
        self.readings += 1
        behind = 2 if self.readings < self.caught_up_at else 3
        return {i: RosterEntry(i, behind if i == 2 else 3, 60, serves_state=False) for i in range(3)}


def _lingering(roster, *, helpers: int, linger_s: float = 30.0) -> HivemindStateExchange:
    states = HivemindStateExchange(
        server=_HelperServes(),
        offers=SimpleNamespace(read=lambda exclude=(), only=None: []),
        roster=roster,
        num_workers=3,
        client_mode=True,
        linger_s=linger_s,
        wants=_wants(_Dht(), "done"),
        helpers=KnownHelpers(["helper"] * helpers),
    )
    states.publish_state(2, StateRank(3, 0.5), lambda: {})
    return states


def test_a_client_of_a_run_of_clients_stays_after_its_last_round_while_another_is_behind_and_a_helper_can_relay():
    roster = _LaggingRoster(caught_up_at=4)
    _lingering(roster, helpers=1).linger()  # returns once worker 2 has finished round 3 (its 4th reading)
    assert roster.readings >= 4
    # bounded: a worker that never catches up is waited for linger_s at most
    started = time.monotonic()
    _lingering(_LaggingRoster(caught_up_at=10**9), helpers=1, linger_s=1.0).linger()
    assert time.monotonic() - started < 5.0
    # without a live helper nobody could take a client's state: it leaves at once
    alone = _LaggingRoster(caught_up_at=10**9)
    started = time.monotonic()
    _lingering(alone, helpers=0).linger()
    assert time.monotonic() - started < 1.0


def test_a_client_of_a_run_with_a_worker_that_serves_states_leaves_at_once_after_its_last_round():
    started = time.monotonic()
    _lingering(_ServingRoster(), helpers=1).linger()  # the serving worker stays for the peers behind
    assert time.monotonic() - started < 1.0


def test_a_helper_withdraws_a_relayed_state_once_every_live_worker_is_past_its_round():
    def live(*rounds: int) -> list[RosterEntry]:
        return [RosterEntry(i, completed, 0) for i, completed in enumerate(rounds)]

    # the state after round 4 (index 3): a worker that completed round 4 only may still want it
    assert not everyone_past(3, live(5, 4))
    assert everyone_past(3, live(5, 5, 6))
    assert not everyone_past(3, [])  # nobody read: keep it
    relayed = RelayedStates()
    assert relayed.put({"round": 3, "peers": 2, "fingerprint": 0.5}, b"state") and relayed.take()
    relayed.forget()
    assert relayed.take() is None  # held no more: a later state of any rank is kept again
    assert relayed.put({"round": 2, "peers": 1, "fingerprint": 0.0}, b"older")


class _FlickeringRoster:
    """A joiner's view (worker 2, a client) of a run whose public worker 0 serves its state: the
    second read misses worker 0's record (a DHT read under load), the others find it."""

    worker_index = 2

    def __init__(self):
        self.reads = 0

    def own_entries(self):
        self.reads += 1
        entries = {i: RosterEntry(i, 3, 60, serves_state=i == 0) for i in range(3)}
        return {i: e for i, e in entries.items() if i != 0} if self.reads == 2 else entries


def test_a_state_that_cannot_be_checked_yet_is_downloaded_again_though_a_roster_read_misses_its_server():
    verdicts = iter([StateVerdict(wait="no other live worker's record shows round 3 completed yet")])
    states = HivemindStateExchange(
        server=_HelperServes(),
        offers=SimpleNamespace(read=lambda exclude=(), only=None: [(2, StateRank(2, 0.5))]),
        roster=_FlickeringRoster(),
        num_workers=3,
        client_mode=True,
        linger_s=0.0,
        wants=_wants(_Dht(), "joiner"),
        helpers=KnownHelpers([]),
    )
    found = states.fetch_state(
        0, better_than=StateRank(1 << 30), timeout_s=20.0, newer=True, check=lambda _: next(verdicts, StateVerdict())
    )
    # the wait is no failed download: the read without a server does not end the search
    assert found is not None and found.round == 2
