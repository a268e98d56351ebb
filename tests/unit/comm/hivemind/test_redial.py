"""The redial chore: who it dials, how often, and never two dials at once (a fake DHT sender)."""

from __future__ import annotations

from concurrent.futures import Future

from diloco.comm.hivemind.redial import Redial


class _Roster:
    def __init__(self):
        self.missing: set[int] = set()
        self.known = {2: ("/ip4/10.0.0.3/tcp/1/p2p/C",), 3: ("/ip4/10.0.0.4/tcp/1/p2p/D",)}

    def addresses_of(self, index: int) -> tuple[str, ...]:
        return self.known.get(index, ())


class _Sender:
    """Takes each request (``fn(dht)``) and records which addresses it would dial."""

    def __init__(self):
        self.dialled: list[list[str]] = []
        self.pending: list[Future] = []

    def __call__(self, fn):
        class _DHT:
            def run_coroutine(_, coroutine, return_future):
                self.dialled.append(coroutine.keywords["maddrs"])
                future = Future()
                self.pending.append(future)
                return future

        return fn(_DHT())


def test_a_worker_dials_the_missing_and_the_initial_peers_again_at_most_once_a_period_and_one_at_a_time():
    now = [0.0]
    roster, send = _Roster(), _Sender()
    redial = Redial(send, roster, ["/ip4/10.0.0.1/tcp/1/p2p/A"], every_s=10.0, clock=lambda: now[0])
    redial()
    assert send.dialled == []  # nobody missing: nothing to dial
    roster.missing = {2, 3}
    redial()
    assert send.dialled == [["/ip4/10.0.0.3/tcp/1/p2p/C", "/ip4/10.0.0.4/tcp/1/p2p/D", "/ip4/10.0.0.1/tcp/1/p2p/A"]]
    now[0] += 20.0
    redial()
    assert len(send.dialled) == 1  # the first dial has not answered yet: no second one beside it
    send.pending[0].set_result(0)
    redial()
    assert len(send.dialled) == 2
    now[0] += 5.0
    send.pending[1].set_result(0)
    redial()
    assert len(send.dialled) == 2  # within the period
    roster.missing = set()  # found again
    now[0] += 20.0
    redial()
    assert len(send.dialled) == 2
