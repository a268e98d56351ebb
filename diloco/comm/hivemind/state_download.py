"""Downloading a peer's state, the offers tried from the highest priority down, leaving out the
peers whose states were refused (``state_exchange.py`` checks what it downloads: a peer that
offered params other than those the run's workers declared is not asked again in that search).

The peers that offer the best state, the same one, serve it in parts at once
(``state_swarm.py``): each serves the manifest of its live state and the parts asked of it
(``state_serving.py``). Where no peer serves a manifest (a helper relays a state as bytes), the
state comes whole from one peer, as hivemind downloads it (``rpc_download_state``).

Stock hivemind (1.1.12) tries its peers in one fixed order and cannot be told to skip one, so a
peer that claims the highest priority would be asked first every time. This is its download, with
the peers to leave out, and the peer that served the state added to what it returns.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence

from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from diloco.comm.hivemind.state_access import REFUSED, StateAccess
from diloco.comm.hivemind.state_parts import Manifest, agreed
from diloco.comm.hivemind.state_swarm import SwarmDownload

logger = logging.getLogger(__name__)

STATE_COPIES = 4  # a global state is at most this many times the params' bytes (Adam: 3, and some)

SERVED_BY = "served_by"  # the metadata key this download adds: the peer the state came from
SOURCES = "sources"  # ... a download in parts adds: the peers that served it (the manifest's)
STATE_BYTES = "state_bytes"  # ... and its bytes
MAX_SOURCES = 4  # the most peers a state is downloaded from at once
RESUMES = 2  # a download in parts that broke is resumed this often (the offers read again)
_FOREVER_S = 365 * 86400.0


class StateDownload:
    """A mix-in of the averager (``averager.ExactAverager``): ``load_state_from_peers`` with
    ``exclude``, in parts from several peers, each request with the proof ``access`` makes (a
    ``StateAccess``, set by the averager)."""

    access: StateAccess

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None, exclude: Sequence[str] = ()):
        """(metadata, state) of the best offer of peers not in ``exclude`` (peer ids as text),
        metadata[SERVED_BY] naming a peer that served it: the state as a dict where it came in
        parts (metadata[SOURCES]: from whom, [STATE_BYTES]: its bytes), else hivemind's tensors
        (the ``torch.save`` bytes); None when none served one."""
        future = MPFuture()
        kwargs = dict(timeout=timeout, future=future, exclude=tuple(exclude))
        self._outer_pipe.send(("_load_state_from_peers", [], kwargs))
        return future.result(timeout=timeout) if wait else future

    async def _load_state_from_peers(self, future: MPFuture, timeout: float | None = None, exclude=()):
        deadline = time.monotonic() + (timeout if timeout is not None else _FOREVER_S)
        if timeout is not None:  # from here on, the most to wait for one message (hivemind's)
            timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        try:
            found = await self._download_in_parts(exclude, timeout, deadline)
            if found is None:  # no peer serves a manifest (a helper's relayed state): whole, as hivemind does
                found = await self._download_whole(exclude, timeout)
            future.set_result(found)
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_whole(self, exclude: Sequence[str], timeout: float | None):
        for peer in self._offering_peers(exclude):
            try:
                found = await self._download_from(peer, timeout)
            except Exception as error:  # that peer failed (or refused us): the next one
                logger.warning("downloading the state of peer %s failed: %s", peer, _reason(error))
                continue
            if found is not None:
                return found
        return None

    async def _download_in_parts(self, exclude: Sequence[str], timeout: float | None, deadline: float):
        """(metadata, state) of the best offer, in parts from the peers that offer it and agree on
        its manifest; a download that broke goes on from the parts it has, with the peers that
        offer it then. None where no peer served a manifest, or the parts did not all come."""
        skipped, download = set(exclude), None
        for _ in range(1 + RESUMES):
            sources = self._same_offer_peers(skipped)
            served = self._within_bound(await self._manifests(sources, timeout))
            if not served:
                return None
            manifest, metadata, peers = agreed(served, [p.to_base58() for p in sources])
            if download is None or download.digest != manifest.digest() or download.metadata != metadata:
                download, started = SwarmDownload(manifest, metadata), time.monotonic()
            fetch = self._parts_fetcher(download.digest, timeout)
            if await download.run(peers[:MAX_SOURCES], fetch, deadline=deadline):
                return self._downloaded(download, peers, time.monotonic() - started)
            skipped |= download.plan.refused
            if time.monotonic() >= deadline:
                return None
        return None

    def _within_bound(self, served: dict[str, tuple[Manifest, bytes]]) -> dict[str, tuple[Manifest, bytes]]:
        """The manifests of states no larger than a global state can be (its params and an outer
        optimizer's moments: ``STATE_COPIES`` x our params' bytes): a peer's claim sizes what we
        allocate before any part of it is checked."""
        bound = STATE_COPIES * sum(t.numel() * t.element_size() for t in self._averaged_tensors)
        for peer, (manifest, _) in served.items():
            if manifest.total_bytes > bound:
                logger.warning("peer %s describes a state of %d bytes, more than ours can be: refused", peer,
                               manifest.total_bytes)  # fmt: skip
        return {peer: found for peer, found in served.items() if found[0].total_bytes <= bound}

    def _downloaded(self, download: SwarmDownload, peers: Sequence[str], seconds: float):
        size = download.manifest.total_bytes + len(download.manifest.skeleton)
        used = {peer: n for peer, n in download.plan.served.items() if n}
        logger.info("downloaded the state in parts: %d bytes in %.2f s from %d peers (parts per peer: %s)",
                    size, seconds, len(used), used)  # fmt: skip
        metadata = MSGPackSerializer.loads(download.metadata)
        sources = [p for p in peers if p in used]
        return {**metadata, SERVED_BY: sources[0], SOURCES: sources, STATE_BYTES: size}, download.state()

    def _same_offer_peers(self, exclude: Sequence[str]) -> list[PeerID]:
        """The peers that offer the best state (the highest priority, the same offer), but us and ``exclude``."""
        offers = self._offers_by_priority(exclude)
        return [peer for peer, priority in offers if priority == offers[0][1]][: 2 * MAX_SOURCES]

    async def _manifests(self, peers: Sequence[PeerID], timeout: float | None) -> dict[str, tuple[Manifest, bytes]]:
        """peer -> (the manifest of the state it serves, its offer's metadata), of those that answered."""

        async def ask(peer: PeerID):
            try:
                stream = await self._part_stub(peer).rpc_download_state_part(self._request(peer, {"manifest": True}))
                async for message in aiter_with_timeout(stream, timeout=timeout):
                    answer = MSGPackSerializer.loads(message.metadata)
                    return peer.to_base58(), (Manifest.from_wire(answer["manifest"]), answer["metadata"])
            except Exception as error:  # an older peer, a stale offer, a broken link, a refusal: not a source
                logger.debug("peer %s served no state manifest: %s", peer, _reason(error))
            return None

        return dict(found for found in await asyncio.gather(*(ask(p) for p in peers)) if found is not None)

    def _parts_fetcher(self, digest: str, timeout: float | None):
        async def fetch(peer: str, parts: range) -> AsyncIterator[tuple[int, bytes]]:
            server = PeerID.from_base58(peer)
            asked = self._request(server, {"digest": digest, "first": parts.start, "stop": parts.stop})
            stream = await self._part_stub(server).rpc_download_state_part(asked)
            async for message in aiter_with_timeout(stream, timeout=timeout):
                yield MSGPackSerializer.loads(message.metadata), message.tensor_part.buffer

        return fetch

    def _request(self, peer: PeerID, asked: dict) -> averaging_pb2.DownloadData:
        """A state request to ``peer``: hivemind's messages are fixed, so what is asked rides in the
        metadata (MSGPack), with the proof that we hold the run key (``state_access.py``)."""
        proven = self.access.request(asked, requester=self.peer_id.to_bytes(), server=peer.to_bytes())
        return averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(proven))

    def _part_stub(self, peer: PeerID):
        return self.get_stub(self._p2p, peer, namespace=self.prefix)

    def _offering_peers(self, exclude: Sequence[str]) -> list[PeerID]:
        """The peers that offer a state, highest priority first (ties in a random order), but us and ``exclude``."""
        return [peer for peer, _ in self._offers_by_priority(exclude)]

    def _offers_by_priority(self, exclude: Sequence[str]) -> list[tuple[PeerID, float]]:
        """(peer, priority) of the peers that offer a state, highest first (ties in a random
        order), but us and ``exclude``."""
        key_manager = self._matchmaking.group_key_manager
        offers, _ = self.dht.get(f"{key_manager.prefix}.all_averagers", latest=True) or ({}, None)
        if not isinstance(offers, dict):
            return []
        priority = {
            PeerID(peer): (float(info.value), random.random())
            for peer, info in offers.items()
            if isinstance(info, ValueWithExpiration) and isinstance(info.value, float | int)
        }
        skipped = {self.peer_id, *(PeerID.from_base58(p) for p in exclude)}
        ranked = sorted(priority, key=priority.get, reverse=True)
        return [(peer, priority[peer][0]) for peer in ranked if peer not in skipped]

    async def _download_from(self, peer: PeerID, timeout: float | None):
        """(metadata with SERVED_BY, tensors) of ``peer``'s state, or None when it sent none."""
        started = time.monotonic()
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(self._request(peer, {}))
        metadata, tensors = await streamed_state(aiter_with_timeout(stream, timeout=timeout))
        if not isinstance(metadata, dict) or not metadata:  # nothing offered now (a stale offer): the next peer
            return None
        logger.info("downloaded the state of peer %s in %.3f s", peer, time.monotonic() - started)
        return {**metadata, SERVED_BY: peer.to_base58()}, tensors


def _reason(error: Exception) -> str:
    """What a failed request says: a refusal's reason alone (hivemind wraps it), else the error."""
    text = str(error)
    return text[text.index(REFUSED) :] if REFUSED in text else repr(error)


async def streamed_state(messages: AsyncIterator[averaging_pb2.DownloadData]) -> tuple[object, list]:
    """(metadata, tensors) of a state streamed as hivemind's averagers stream one: the metadata with
    the first message, each tensor in parts, a part that carries a dtype starting the next tensor."""
    metadata, parts, tensors = None, [], []
    async for message in messages:
        if message.metadata:
            metadata = MSGPackSerializer.loads(message.metadata)
        if message.tensor_part.dtype and parts:  # the start of the next tensor
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            parts = []
        parts.append(message.tensor_part)
    if parts:
        tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
    return metadata, tensors
