"""Finding the run's peers again after the network between them failed and came back.

When the link between two groups of workers fails (a site's uplink, a cable, a home router
rebooting), each side's DHT peers stop answering the other's and drop them from their routing
tables; hivemind never dials them again on its own, so after the network heals each side would
go on finding only its own records and its own groups: two runs. A worker that misses workers
it has seen (``Roster.missing``: not live, never said they were leaving) dials them again, at
the addresses their roster records announced, and the run's initial peers, every
``REDIAL_HEARTBEATS`` heartbeats (``comm.hivemind.heartbeat_s``), one dial at a time. A peer that
answers is back in the routing table both ways: the roster then shows the other side live, rounds
expect it, and its groups meet ours (the merge itself is ``group_round.py``'s: a group that holds
two models).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

# how often a worker that misses others dials them again: each heartbeat, 3 s at the default (a dial is a
# connect and a ping of each missing peer; one to a peer still cut off ends in DIAL_S)
REDIAL_HEARTBEATS = 1
DIAL_S = 5.0  # one dial and ping


def redial_every_s(heartbeat_s: float) -> float:
    """The least time between two dials: ``REDIAL_HEARTBEATS`` heartbeats less half a heartbeat, as
    the heartbeat's chores run about a heartbeat apart, not exactly."""
    return (REDIAL_HEARTBEATS - 0.5) * heartbeat_s


async def _dial_and_ping(dht, node, *, maddrs: Sequence[str], timeout_s: float) -> int:
    """Inside the DHT's process: connect to each of ``maddrs`` (``/.../p2p/ID``) and ping it, so that
    both ends put the other in their routing tables again. Returns how many answered."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def one(text: str) -> bool:
        address = Multiaddr(text)
        peer_id = PeerID.from_base58(address["p2p"])
        if peer_id == node.peer_id:
            return False
        where = address.decapsulate(Multiaddr(f"/p2p/{address['p2p']}"))
        try:
            await asyncio.wait_for(node.p2p._client.connect(peer_id, [where]), timeout_s)
            answered = await asyncio.wait_for(node.protocol.call_ping(peer_id), timeout_s) is not None
        except Exception:  # not reachable yet: the next heartbeat's redial tries again
            return False
        if answered:
            node.blacklist.register_success(peer_id)  # found again: no longer skipped by lookups
        return answered

    results = await asyncio.gather(*(one(m) for m in dict.fromkeys(maddrs)), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):  # a malformed address, say: the others are still dialled
            logger.debug("redial failed: %r", result)
    return sum(result is True for result in results)


def dial(send: Callable, maddrs: Sequence[str], *, timeout_s: float = DIAL_S):
    """Dial and ping ``maddrs`` from our DHT peer without waiting (``send``: ``Peer.send``); the
    future's result is how many answered."""
    coroutine = functools.partial(_dial_and_ping, maddrs=list(maddrs), timeout_s=timeout_s)
    return send(lambda dht: dht.run_coroutine(coroutine, return_future=True))


class Redial:
    """A heartbeat chore (``Roster.chores``): while ``roster`` misses workers it has seen,
    dial them and ``initial_peers`` again every ``every_s`` seconds (one dial at a time, never waited for
    on the heartbeat's thread); logs once when they are live again."""

    def __init__(self, send: Callable, roster, initial_peers: Sequence[str], *, every_s: float, clock=None):
        self._send, self.roster, self.initial_peers = send, roster, list(initial_peers)
        self.every_s = every_s
        self._clock = clock or time.monotonic
        self._last = float("-inf")
        self._pending = None  # the dial in flight
        self._dialled: set[int] = set()  # the missing workers we dialled

    def __call__(self) -> None:
        missing = self.roster.missing
        if not missing:
            if self._dialled:
                found = ", ".join(map(str, sorted(self._dialled)))
                logger.warning("found again the workers that were missing (%s): the run is whole", found)
            self._dialled = set()
            return
        now = self._clock()
        if now - self._last < self.every_s or (self._pending is not None and not self._pending.done()):
            return
        maddrs = [a for index in sorted(missing) for a in self.roster.addresses_of(index)] + self.initial_peers
        if maddrs:
            if self._pending is not None and self._pending.exception() is None:
                logger.debug("redial: %d answered (missing workers %s)", self._pending.result(), sorted(missing))
            self._last, self._dialled = now, self._dialled | missing
            self._pending = dial(self._send, maddrs)
