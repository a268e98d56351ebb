"""Downloading a peer's state, the offers tried from the highest priority down, leaving out the
peers whose states were refused (``state_exchange.py`` checks what it downloads: a peer that
offered params other than those the run's workers declared is not asked again in that search).

Stock hivemind (1.1.12) tries its peers in one fixed order and cannot be told to skip one, so a
peer that claims the highest priority would be asked first every time. This is its download, with
the peers to leave out, and the peer that served the state added to what it returns.
"""

from __future__ import annotations

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

logger = logging.getLogger(__name__)

SERVED_BY = "served_by"  # the metadata key this download adds: the peer the state came from


class StateDownload:
    """A mix-in of the averager (``averager.ExactAverager``): ``load_state_from_peers`` with ``exclude``."""

    def load_state_from_peers(self, wait: bool = True, timeout: float | None = None, exclude: Sequence[str] = ()):
        """(metadata, tensors) of the best offer of a peer not in ``exclude`` (peer ids as text),
        metadata[SERVED_BY] naming that peer; None when none served one."""
        future = MPFuture()
        kwargs = dict(timeout=timeout, future=future, exclude=tuple(exclude))
        self._outer_pipe.send(("_load_state_from_peers", [], kwargs))
        return future.result(timeout=timeout) if wait else future

    async def _load_state_from_peers(self, future: MPFuture, timeout: float | None = None, exclude=()):
        if timeout is not None:
            timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        try:
            for peer in self._offering_peers(exclude):
                try:
                    found = await self._download_from(peer, timeout)
                except Exception as error:  # that peer failed: the next one
                    logger.warning("downloading the state of peer %s failed: %r", peer, error)
                    continue
                if found is not None:
                    future.set_result(found)
                    return
        finally:
            if not future.done():
                future.set_result(None)

    def _offering_peers(self, exclude: Sequence[str]) -> list[PeerID]:
        """The peers that offer a state, highest priority first (ties in a random order), but us and ``exclude``."""
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
        return [peer for peer in sorted(priority, key=priority.get, reverse=True) if peer not in skipped]

    async def _download_from(self, peer: PeerID, timeout: float | None):
        """(metadata with SERVED_BY, tensors) of ``peer``'s state, or None when it sent none."""
        started = time.monotonic()
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, tensors = await streamed_state(aiter_with_timeout(stream, timeout=timeout))
        if not isinstance(metadata, dict) or not metadata:  # nothing offered now (a stale offer): the next peer
            return None
        logger.info("downloaded the state of peer %s in %.3f s", peer, time.monotonic() - started)
        return {**metadata, SERVED_BY: peer.to_base58()}, tensors


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
