"""How a worker's ``Peer`` starts with ``comm.hivemind.client_mode=auto``: a joiner that can be dialled
starts as a client that asks to be dialled back, then again as a full peer on the same port; one
that cannot stays the client it started as; one that need not ask starts once, as what it is. The
DHT peers here are fakes (their start and shutdown recorded); the dial-back between real peers in
network namespaces is tests/integration/test_nat.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from diloco.comm.hivemind import reachability
from diloco.comm.hivemind.peer import Peer, PortInUse
from diloco.comm.hivemind.settings import HivemindConfig

RUN = ["/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWRun"]
JOINER = {"host": "0.0.0.0", "initial_peers": RUN}


class _Starts:
    """``start_dht`` as ``Peer`` calls it: each start and shutdown recorded in ``events``; a peer told
    port 0 listens on 4002; ``taken``: how many starts on each port fail as an address in use does."""

    def __init__(self, taken: dict[int, int] | None = None):
        self.events: list[tuple] = []
        self.taken = dict(taken or {})

    def __call__(self, cfg, *, run_key, client_mode):
        if self.taken.get(cfg.port, 0) > 0:
            self.taken[cfg.port] -= 1
            raise PortInUse(f"comm.hivemind.port={cfg.port} is already in use")
        self.events.append(("start", cfg.port, client_mode))
        port = cfg.port or 4002
        hosts = ["127.0.0.1"] if cfg.host == "127.0.0.1" else ["127.0.0.1", "10.0.0.7"]  # 0.0.0.0: every interface
        maddrs = [f"/ip4/{host}/tcp/{port}/p2p/Us" for host in hosts]
        return SimpleNamespace(peer_id="Us", get_visible_maddrs=lambda: maddrs, shutdown=self._stop)

    def _stop(self):
        self.events.append(("stop",))


def _peer(monkeypatch, verdict, starts=None, **settings) -> tuple[Peer, _Starts, list]:
    """A ``Peer`` of ``settings`` whose dial-back request gets ``verdict`` (raised, if an exception)."""
    asked = []

    def ask(call, peer_id, addresses, *, timeout_s):
        asked.append(addresses)
        if isinstance(verdict, Exception):
            raise verdict
        return verdict

    monkeypatch.setattr(reachability, "ask", ask)
    starts = starts or _Starts()
    return Peer(HivemindConfig(**settings), run_key="", start=starts), starts, asked


@pytest.mark.parametrize("verdict", [True, None, TimeoutError("the DHT did not answer")])
def test_a_joiner_dialled_back_or_not_answered_starts_as_a_client_then_as_a_full_peer_on_the_same_port(
    monkeypatch, verdict
):
    peer, starts, asked = _peer(monkeypatch, verdict, **JOINER)
    assert asked == [[("10.0.0.7", 4002)]]
    assert starts.events == [("start", 0, True), ("stop",), ("start", 4002, False)] and not peer.client_mode


def test_a_joiner_not_dialled_back_stays_the_client_it_started_as(monkeypatch):
    peer, starts, asked = _peer(monkeypatch, False, **JOINER)
    assert asked and starts.events == [("start", 0, True)] and peer.client_mode
    assert peer.addresses == RUN  # a newcomer joins through the peers it joined through


class _HeldAfterStop(_Starts):
    """The previous daemon holds ``port`` for ``tries`` more starts after the peer stopped it."""

    def __init__(self, port: int, tries: int):
        super().__init__()
        self.port, self.tries = port, tries

    def _stop(self):
        super()._stop()
        self.taken[self.port] = self.tries


def test_a_joiner_on_a_fixed_port_starts_again_on_it_once_its_previous_daemon_let_go(monkeypatch):
    starts = _HeldAfterStop(31337, tries=2)
    peer, _, _ = _peer(monkeypatch, True, starts=starts, port=31337, announce_host="198.51.100.7", **JOINER)
    assert starts.events == [("start", 31337, True), ("stop",), ("start", 31337, False)] and not peer.client_mode


def test_a_joiner_on_any_port_whose_port_is_held_a_moment_takes_another(monkeypatch):
    starts = _HeldAfterStop(4002, tries=2)
    peer, _, _ = _peer(monkeypatch, True, starts=starts, **JOINER)
    assert starts.events == [("start", 0, True), ("stop",), ("start", 0, False)] and not peer.client_mode


def test_a_joiner_whose_fixed_port_is_never_freed_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr("diloco.comm.hivemind.peer._PORT_FREED_S", 0.3)
    with pytest.raises(PortInUse, match="comm.hivemind.port=31337 is already in use"):
        _peer(monkeypatch, True, starts=_HeldAfterStop(31337, tries=10**6), port=31337, **JOINER)


@pytest.mark.parametrize(
    ("settings", "client"),
    [
        ({"host": "0.0.0.0"}, False),  # starts a run: nobody to ask
        ({"initial_peers": ["/ip4/127.0.0.1/tcp/5/p2p/B"]}, False),  # a run on loopback, joined from loopback
        ({"initial_peers": RUN}, True),  # on loopback, in a run elsewhere: nobody there can dial it
        ({"initial_peers": RUN, "announce_host": "198.51.100.7"}, True),  # announced only with a fixed port
        ({**JOINER, "client_mode": "true"}, True),
        ({**JOINER, "client_mode": "false"}, False),
    ],
)
def test_a_peer_that_need_not_ask_starts_once_as_what_it_is(monkeypatch, settings, client):
    peer, starts, asked = _peer(monkeypatch, True, **settings)
    assert asked == [] and starts.events == [("start", 0, client)] and peer.client_mode == client
