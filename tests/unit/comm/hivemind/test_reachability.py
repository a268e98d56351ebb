"""Which addresses a peer can be dialled at, and when a joiner must be a client without asking
(the dial-back itself runs between real peers in network namespaces: tests/integration/test_nat.py)."""

from __future__ import annotations

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
