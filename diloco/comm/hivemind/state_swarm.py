"""One download of a state in parts from several peers at once (as BitTorrent takes a file).

The peers serve the same state (one ``Manifest``, ``state_parts.py``): each fetches runs of
missing parts in turn, so that a faster peer serves more. Every part is checked against the
manifest and written straight into the tensors allocated for the state. A peer that serves a bad
part is refused (its parts go to the others); one whose stream broke or whose offer went stale
leaves its parts to the others. What came stays: ``run`` again, with other peers, fetches only
the parts still missing. The transport is the caller's (``fetch``): ``state_download.py``'s is
hivemind's p2p.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from diloco.comm.hivemind.state_parts import Manifest, Plan, byte_views, write_range

logger = logging.getLogger(__name__)

SPAN_PARTS = 8  # parts a peer is asked for at once (8 MiB at most)

# fetch(peer, parts): the parts ``peer`` sends of those asked, as (index, bytes), in any order
FetchParts = Callable[[str, range], AsyncIterator[tuple[int, bytes]]]


class SwarmDownload:
    """The download of the state ``manifest`` describes (``metadata``: its offer's, as sent)."""

    def __init__(self, manifest: Manifest, metadata: bytes):
        self.manifest, self.metadata = manifest, metadata
        self.digest = manifest.digest()
        self.tensors = manifest.allocate()
        self._views = byte_views(self.tensors)
        self.plan = Plan(manifest.parts, span=SPAN_PARTS)
        self._changed = asyncio.Event()  # a run of parts ended, well or not: parts may be free again

    @property
    def done(self) -> bool:
        return self.plan.done

    def state(self) -> object:
        """The downloaded state (once ``done``)."""
        return self.manifest.state(self.tensors)

    async def run(self, peers: Sequence[str], fetch: FetchParts, *, deadline: float) -> bool:
        """Fetch the missing parts from ``peers`` at once until none is missing (True), or none of
        them can serve more, or ``deadline`` (``time.monotonic()``) passed (False)."""
        await asyncio.gather(*(self._from(peer, fetch, deadline) for peer in peers))
        return self.plan.done

    async def _from(self, peer: str, fetch: FetchParts, deadline: float) -> None:
        while not self.plan.done and time.monotonic() < deadline:
            parts = self.plan.take(peer)
            if parts is None:  # the others fetch what is left: wait for one of them to end a run
                if peer in self.plan.refused or not self.plan.in_flight:
                    return
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    return
                continue
            try:
                served = await self._fetch_run(peer, parts, fetch, deadline)
            finally:
                self._changed.set()
            if not served:
                return

    async def _fetch_run(self, peer: str, parts: range, fetch: FetchParts, deadline: float) -> bool:
        """Fetch ``parts`` from ``peer``; whether it served them all (those it did not are missing again)."""
        pending = set(parts)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                async for part, data in fetch(peer, parts):
                    if part not in pending or not self.manifest.holds(part, data):
                        logger.warning("peer %s served part %d of the state corrupt: refused, its parts fetched "
                                       "from the other peers", peer, part)  # fmt: skip
                        self.plan.refuse(peer, pending)
                        return False
                    write_range(self._views, self.manifest.span(part)[0], data)
                    pending.discard(part)
                    self.plan.landed(part, peer)
        except Exception as error:  # a broken stream, a timeout: the others take its parts
            logger.warning("downloading parts of the state from peer %s failed: %r", peer, error)
        self.plan.missed(pending)
        if pending:  # an offer gone stale answers nothing; one that broke is asked no more in this run
            logger.info("peer %s did not serve %d parts of the state: fetched from the others", peer, len(pending))
        return not pending
