"""Which addresses a peer can be dialled at, when a joiner must be a client without asking, how a
peer starts (as a client that asks, then again as a full peer on the same port when dialled back;
the dial-back itself runs between real peers in network namespaces: tests/integration/test_nat.py),
and that a peer answering dial-back requests dials every requester at once."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from diloco.comm.base import CommError, HivemindConfig
from diloco.comm.hivemind import reachability
from diloco.comm.hivemind.peer import Peer
from diloco.comm.hivemind.reachability import dialable_addresses, listens_where_the_run_cannot_dial

RUN = ["/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWRun"]


def test_only_tcp_addresses_off_loopback_can_be_dialled():
    announced = ["/ip4/127.0.0.1/tcp/4001/p2p/X", "/ip4/10.0.0.7/tcp/4002/p2p/X", "/ip4/10.0.0.7/udp/4003/quic"]
    assert dialable_addresses(announced) == [("10.0.0.7", 4002)]


def test_a_joiner_on_loopback_only_in_a_run_elsewhere_must_be_a_client():
    assert listens_where_the_run_cannot_dial(["/ip4/127.0.0.1/tcp/4001/p2p/X"], RUN)


def test_a_joiner_others_may_dial_or_a_run_on_loopback_is_left_to_the_dial_back():
    assert not listens_where_the_run_cannot_dial(["/ip4/10.0.0.7/tcp/4002/p2p/X"], RUN)
    assert not listens_where_the_run_cannot_dial(["/ip4/127.0.0.1/tcp/4001/p2p/X"], ["/ip4/127.0.0.1/tcp/5/p2p/B"])


class _Starts:
    """``start_dht`` as ``Peer`` calls it: each start's (port, client mode) recorded; a peer told
    port 0 listens on 4002; ``taken``: ports whose start fails as an address in use does."""

    def __init__(self, taken: tuple[int, ...] = ()):
        self.started: list[tuple[int, bool]] = []
        self.taken, self.stopped = taken, 0

    def __call__(self, cfg, *, run_key, client_mode):
        if cfg.port in self.taken:
            raise CommError(f"comm.hivemind.port={cfg.port} is already in use")
        self.started.append((cfg.port, client_mode))
        port = cfg.port or 4002
        hosts = ["127.0.0.1"] if cfg.host == "127.0.0.1" else ["127.0.0.1", "10.0.0.7"]  # 0.0.0.0: every interface
        maddrs = [f"/ip4/{host}/tcp/{port}/p2p/Us" for host in hosts]
        return SimpleNamespace(peer_id="Us", get_visible_maddrs=lambda: maddrs, shutdown=self._stop)

    def _stop(self):
        self.stopped += 1


def _peer(monkeypatch, verdict, starts=None, **settings) -> tuple[Peer, _Starts, list]:
    asked = []

    def ask(call, peer_id, addresses, *, timeout_s):
        asked.append(addresses)
        return verdict

    monkeypatch.setattr(reachability, "ask", ask)
    starts = starts or _Starts()
    return Peer(HivemindConfig(**settings), run_key="", start=starts), starts, asked


JOINER = {"host": "0.0.0.0", "initial_peers": RUN}


@pytest.mark.parametrize("verdict", [True, None])
def test_a_joiner_dialled_back_or_not_answered_starts_as_a_client_then_as_a_full_peer_on_the_same_port(
    monkeypatch, verdict
):
    peer, starts, asked = _peer(monkeypatch, verdict, **JOINER)
    assert asked == [[("10.0.0.7", 4002)]]
    assert starts.started == [(0, True), (4002, False)] and starts.stopped == 1 and not peer.client_mode


def test_a_joiner_not_dialled_back_stays_the_client_it_started_as(monkeypatch):
    peer, starts, asked = _peer(monkeypatch, False, **JOINER)
    assert asked and starts.started == [(0, True)] and starts.stopped == 0 and peer.client_mode
    assert peer.addresses == RUN  # a newcomer joins through the peers it joined through


def test_a_joiner_whose_port_was_taken_meanwhile_listens_on_another(monkeypatch):
    peer, starts, _ = _peer(monkeypatch, True, starts=_Starts(taken=(4002,)), **JOINER)
    assert starts.started == [(0, True), (0, False)] and not peer.client_mode


@pytest.mark.parametrize(
    ("settings", "client"),
    [
        ({"host": "0.0.0.0"}, False),  # starts a run: nobody to ask
        ({"initial_peers": ["/ip4/127.0.0.1/tcp/5/p2p/B"]}, False),  # a run on loopback, joined from loopback
        ({"initial_peers": RUN}, True),  # on loopback, in a run elsewhere: nobody there can dial it
        ({**JOINER, "client_mode": "true"}, True),
        ({**JOINER, "client_mode": "false"}, False),
    ],
)
def test_a_peer_that_need_not_ask_starts_once_as_what_it_is(monkeypatch, settings, client):
    peer, starts, asked = _peer(monkeypatch, True, **settings)
    assert asked == [] and starts.started == [(0, client)] and peer.client_mode == client


class _Requests:
    """The DHT as ``answer`` sees it: dial-back requests to read, verdicts written."""

    def __init__(self, requests: dict):
        self.requests, self.verdicts = requests, {}

    def get(self, key, latest, return_future):
        items = {peer: SimpleNamespace(value=request) for peer, request in self.requests.items()}
        return SimpleNamespace(value=items) if key == reachability.REQUESTS_KEY else None

    def store(self, key, subkey, value, expiration_time, return_future):
        self.verdicts[subkey] = value


def test_requests_are_dialled_back_at_once_and_each_answered_once(monkeypatch):
    dialling = threading.Barrier(3, timeout=10)  # passes only when all three dial at the same time

    def can_dial(host, port, timeout_s=0.0):
        dialling.wait()
        return port == 1

    monkeypatch.setattr(reachability, "can_dial", can_dial)
    dht = _Requests({f"peer{i}": {"addresses": [["10.0.0.7", i]], "at": 5.0} for i in range(3)})
    answered: dict[str, float] = {}
    assert reachability.answer(lambda call: call(dht), own_peer_id="us", answered=answered) == 3
    assert {peer: v["reachable"] for peer, v in dht.verdicts.items()} == {"peer0": False, "peer1": True, "peer2": False}
    assert reachability.answer(lambda call: call(dht), own_peer_id="us", answered=answered) == 0  # none new


def test_a_request_that_cannot_be_dialled_is_answered_unreachable_and_holds_nobody_else(monkeypatch):
    def can_dial(host, port, timeout_s=0.0):
        if port > 65535:
            raise OverflowError("port must be 0-65535")
        return True

    monkeypatch.setattr(reachability, "can_dial", can_dial)
    dht = _Requests(
        {
            "odd": {"addresses": [["10.0.0.7", 10**20]], "at": 5.0},
            "garbled": {"addresses": [["10.0.0.7", "no port"]], "at": 5.0},
            "fine": {"addresses": [["10.0.0.8", 4001]], "at": 5.0},
        }
    )
    assert reachability.answer(lambda call: call(dht), own_peer_id="us", answered={}) == 3
    assert {peer: v["reachable"] for peer, v in dht.verdicts.items()} == {"odd": False, "garbled": False, "fine": True}
