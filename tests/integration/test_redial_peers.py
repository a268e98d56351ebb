"""Redial with real hivemind DHT peers on loopback: a peer dials another it was never connected to
(as a side of a healed split dials the other), and then reads what that one stores."""

from __future__ import annotations

import threading

import pytest

from diloco.comm.hivemind.redial import dial

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_peer_dialled_again_answers_and_its_records_are_read_through_the_dht():
    import hivemind
    from hivemind.utils import get_dht_time

    ours = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    theirs = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        lock = threading.Lock()

        def send(fn):
            with lock:
                return fn(ours)

        theirs.store("roster", "theirs", get_dht_time() + 60)
        assert ours.get("roster", latest=True) is None  # two DHTs that do not know each other
        addresses = [str(a) for a in theirs.get_visible_maddrs()]
        assert dial(send, addresses + ["/ip4/127.0.0.1/tcp/1/p2p/" + str(ours.peer_id)]).result(timeout=30) == 1
        assert ours.get("roster", latest=True).value == "theirs"  # one DHT again
    finally:
        ours.shutdown()
        theirs.shutdown()
