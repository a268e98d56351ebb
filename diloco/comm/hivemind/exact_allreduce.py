"""hivemind's butterfly all-reduce, changed so that every peer ends a round bit-identical.

Stock hivemind (1.1.12) runs a butterfly all-reduce in which each peer reduces one part of the
vector and sends every sender back ``average - what_you_sent``; the sender adds that delta to
its own part. ``x + (avg - x)`` is not ``avg`` in floating point, so peers drift apart by an
ulp per round and their parameter hashes never agree. Here a reducer returns the averaged part
itself, the peers copy it in, and the reducer keeps exactly the values it sent. The same rule
makes lossy codecs safe: whatever a reducer sends is what everyone, itself included, uses.

This module is a sender's side: our parts of each other peer's share sent compressed by the run's
codec (``wire.py``) and its averaged parts copied in, and our own share reduced here and kept as
the others receive it. The reducer's side, serving the senders of our share, is
``exact_reducing.py``; what each peer screens, ``screening.py``. A codec that ``gathers`` (top-k)
is not averaged by the reducer: it sends each sender the other kept senders' payloads of the part,
and every peer takes their mean itself (``gathered.py``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, as_aiter, attach_event_on_finished

from diloco.comm.hivemind import gathered
from diloco.comm.hivemind.exact_reducing import ShareReducing
from diloco.comm.hivemind.reducer import reducer_for
from diloco.comm.hivemind.traffic import TrafficCounters
from diloco.comm.hivemind.wire import as_sent, bytes_part, compressed_as_sent, decode_part
from diloco.comm.robust import Screening
from diloco.compression import Codec, PayloadError

logger = logging.getLogger(__name__)


class ExactAllReduceRunner(ShareReducing, AllReduceRunner):
    """Butterfly all-reduce whose reducers hand out the average itself, not a delta."""

    def __init__(
        self,
        *args,
        traffic: TrafficCounters,
        codec: Codec,
        screening: Screening | None = None,
        norms: dict | None = None,
        weights: dict | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.tensor_part_reducer.finished.set()  # hivemind's own, replaced: never used, nothing to report

        # a failed reducer's part falls back to our own values rather than a zero delta
        self.tensor_part_container.return_deltas = False
        self.traffic, self.codec = traffic, codec
        self._left_behind = False  # a member of this group refused our parts: counted once
        self.lost_reducers = 0  # other members whose averaged parts did not all come back to us
        self._replies: dict[int, asyncio.Future] = {}  # our share: part -> (payload, decoded)
        self._replies_taken: collections.Counter[int] = collections.Counter()
        # a codec that gathers (gathered.py): what each sender sent of each part of our share,
        # and what we sent each reducer of each part of theirs
        self._kept: dict[int, dict[int, gathered.Kept]] = {}
        self._own_payloads: dict[tuple[int, int], bytes] = {}
        # robust aggregation: who every peer drops, each kept sender's factor, and the norms declared
        self.screening = screening or Screening(scales={peer: 1.0 for peer in self.ordered_peer_ids})
        # how many take each reply: the senders every peer keeps (us included); one all took is let go
        self._reply_takers = sum(peer not in self.screening.dropped for peer in self.sender_peer_ids)
        shapes, senders = self.tensor_part_reducer.part_shapes, self.tensor_part_reducer.num_senders
        excluded = frozenset(i for i, peer in enumerate(self.sender_peer_ids) if peer in self.screening.excluded)
        self.tensor_part_reducer = reducer_for(shapes, senders, excluded=excluded)
        self.norms, self.weights = norms or {}, weights or {}  # what each sender declared at matchmaking
        self._received_squares: dict[PeerID, float] = {}  # sum of the squared norms of a sender's parts so far
        self.payload_dropped: dict[PeerID, str] = {}  # senders whose parts we could not use, and why

    async def run(self):
        # refuse the senders every peer drops before anything arrives, and count them as started
        # (hivemind otherwise waits for them up to its sender timeout before it finishes the round)
        for peer in self.sender_peer_ids:
            if peer in self.screening.dropped:
                self.active_senders.add(peer)
                await self._ban_sender(peer)
        if len(self.active_senders) == len(self.sender_peer_ids):
            self.all_senders_started.set()
        async for output in super().run():
            yield output

    async def _count_received(self, messages: AsyncIterator[averaging_pb2.AveragingData]):
        async for message in messages:
            self.traffic.add(recv=message.ByteSize())
            yield message

    def _input_parts(self, peer_index: int) -> list[torch.Tensor]:
        return [part for part, _ in self.tensor_part_container._input_parts_by_peer[peer_index]]

    async def _generate_input_for_peer(self, peer_index: int):
        self.tensor_part_container._inputs_consumed_by_peer[peer_index] = True
        payloads = amap_in_executor(
            self.codec.compress,
            as_aiter(*self._input_parts(peer_index)),
            max_prefetch=self.tensor_part_container.prefetch,
        )
        first, part_index = True, 0
        async for payload in payloads:
            if self.codec.gathers:
                self._own_payloads[(peer_index, part_index)] = payload
            part_index += 1
            message = averaging_pb2.AveragingData(tensor_part=bytes_part(payload), weight=self.weight)
            if first:
                message.code, message.group_id, first = averaging_pb2.PART_FOR_AVERAGING, self.group_id, False
            self.traffic.add(sent=message.ByteSize())
            yield message

    def _gathered_mean(self, serialized: runtime_pb2.Tensor, numel: int, own: bytes | None) -> torch.Tensor:
        """A reducer's gathered reply to us, read as it reads it: the mean of the kept payloads."""
        if serialized.dtype != "uint8" or serialized.compression != runtime_pb2.CompressionType.NONE:
            raise PayloadError(f"payload is a {serialized.dtype} tensor, not the bytes of a gathered reply")
        if numel < 0:
            raise PayloadError("more parts than this peer reduces")
        me = self.sender_peer_ids.index(self.peer_id)
        kept = gathered.unpack(serialized.buffer, recipient=me, own=own)
        return gathered.mean(self.codec, kept, numel, self._scales_by_sender)

    async def _communicate_with_peer(self, peer_id: PeerID):
        peer_index = self.ordered_peer_ids.index(peer_id)
        if self.peer_id in self.screening.dropped:
            # every reducer refuses us this round (it banned us up front): send nothing, keep our values
            if peer_id == self.peer_id:
                await self.tensor_part_reducer.finished.wait()  # keep serving the others until they are done
            self.tensor_part_container.register_failed_reducer(peer_index)
            return
        if peer_id != self.peer_id:
            return await self._exchange_with_reducer(peer_id)
        # our own share: reduce it locally and keep what the others get (the stock runner keeps a delta)
        sender_index = self.sender_peer_ids.index(peer_id)
        scale, weight = self.screening.scales.get(peer_id, 1.0), self.screening.weight(self.weight)
        loop = asyncio.get_event_loop()
        for part_index, part in enumerate(self.parts_for_local_averaging):
            try:  # our part as the others would decode it
                if self.codec.gathers:  # and its bytes, which the others take the mean from
                    payload, sent = await loop.run_in_executor(None, compressed_as_sent, self.codec, part)
                    self._kept.setdefault(part_index, {})[sender_index] = gathered.Kept(sender_index, weight, payload)
                else:
                    sent = await loop.run_in_executor(None, as_sent, self.codec, part)
                if scale != 1.0:
                    sent = sent * scale
            except PayloadError as error:  # as a peer would, the reducer drops what it cannot read
                logger.warning("dropped our own contribution: %s", error)
                self.traffic.add(own_drops=1)
                await self._ban_sender(peer_id)
                await self.tensor_part_reducer.finished.wait()  # keep serving the others until they are done
                self.tensor_part_container.register_failed_reducer(peer_index)
                return
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, sent, weight=weight)
            self.traffic.note_contributions(self.tensor_part_reducer.contributions.get(part_index, 0))
            try:
                if self.codec.gathers:
                    _, restored = await self._gathered(part_index, part.numel())
                else:
                    _, restored = await self._reply(part_index, averaged)
            except PayloadError as error:
                logger.warning("our share's average is unusable: %s", error)
                self.tensor_part_container.register_failed_reducer(peer_index)
                return
            self.tensor_part_container.register_processed_part(peer_index, part_index, restored)

    async def _exchange_with_reducer(self, peer_id: PeerID):
        """Send our parts of ``peer_id``'s share and copy in the averaged parts it replies, each
        checked and decoded once, straight into hivemind's container (as its runner does)."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        numels = [part.numel() for part in self._input_parts(peer_index)]
        expected_parts = self.tensor_part_container.num_parts_by_peer[peer_index]
        loop = asyncio.get_event_loop()
        part_index = 0  # the averaged parts it sent back so far
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            async for message in aiter_with_timeout(self._count_received(stream), self.reducer_timeout):
                if message.code != averaging_pb2.AVERAGED_PART:
                    if message.code == averaging_pb2.BAD_GROUP_ID and self._never_sent(peer_id):
                        await self._ban_sender(peer_id)  # not in this group: our share waits for none of its parts
                        if not self._left_behind:  # it retries the round, and so do we (averaging.py)
                            self._left_behind = True
                            self.traffic.groups_left_behind(+1)
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
                if message.weight > 0:  # the reducer says over how many contributions it averaged the part
                    self.traffic.note_contributions(int(message.weight))
                numel = numels[part_index] if part_index < len(numels) else -1
                try:  # an average, or (a codec that gathers) the payloads to take it from
                    if self.codec.gathers:
                        own = self._own_payloads.get((peer_index, part_index))
                        part = await loop.run_in_executor(None, self._gathered_mean, message.tensor_part, numel, own)
                    else:
                        part = await loop.run_in_executor(None, decode_part, self.codec, message.tensor_part, numel)
                except PayloadError as error:
                    logger.warning("reducer %s sent an unusable averaged part: %s", peer_id, error)
                    raise
                self.tensor_part_container.register_processed_part(peer_index, part_index, part)
                part_index += 1
            if part_index != expected_parts:
                raise AllreduceException(f"peer {peer_id} sent {part_index} parts, but we expected {expected_parts}")
        except BaseException as error:
            if isinstance(error, Exception):  # not a cancellation: the exchange itself failed
                logger.debug("caught %r when communicating with %s", error, peer_id, exc_info=True)
                if part_index < expected_parts:  # not one that failed as its stream closed
                    self.lost_reducers += 1
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    def _never_sent(self, peer_id: PeerID) -> bool:
        """Whether ``peer_id`` is a sender of this group that has not begun sending us its parts."""
        return peer_id in self.sender_peer_ids and peer_id not in self.active_senders
