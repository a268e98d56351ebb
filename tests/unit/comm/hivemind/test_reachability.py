"""Which addresses a peer can be dialled at, when a joiner must be a client without asking (how a
``Peer`` starts: test_peer.py; the dial-back itself runs between real peers in network namespaces:
tests/integration/test_nat.py), and that a peer answering dial-back requests dials every requester
at once."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from diloco.comm.hivemind import reachability
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
