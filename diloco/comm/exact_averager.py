"""hivemind's decentralized averager, changed so that every peer ends a round bit-identical.

Stock hivemind (1.1.12) runs a butterfly all-reduce in which each peer reduces one part of the
vector and sends every sender back ``average - what_you_sent``; the sender adds that delta to
its own part. ``x + (avg - x)`` is not ``avg`` in floating point, so peers drift apart by an
ulp per round and their parameter hashes never agree. Here a reducer returns the averaged part
itself, the peers copy it in, and the reducer keeps exactly the values it sent. The same rule
makes lossy codecs safe later: whatever a reducer sends is what everyone, itself included, uses.

The runner also counts the bytes of every averaging message it sends and receives, so a round
reports traffic measured on the wire rather than estimated.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
from collections.abc import AsyncIterator, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import BannedException
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor, as_aiter, azip


class _TrafficCounters:
    """Running totals shared between the averager's process and the worker's.

    Totals only grow: a reducer may still be sending its last replies when the worker's own
    step has returned, so a round's traffic is read as the difference between two readings
    and late bytes are counted in the next one, never lost.
    """

    def __init__(self):
        self._sent = mp.Value(ctypes.c_int64, 0)
        self._recv = mp.Value(ctypes.c_int64, 0)
        self._failed_values = mp.Value(ctypes.c_int64, 0)

    def add(self, *, sent: int = 0, recv: int = 0, failed_values: int = 0) -> None:
        for counter, amount in ((self._sent, sent), (self._recv, recv), (self._failed_values, failed_values)):
            if amount:
                with counter.get_lock():
                    counter.value += amount

    def read(self) -> tuple[int, int, int]:
        """(bytes sent, bytes received, values whose reducer failed) so far."""
        return self._sent.value, self._recv.value, self._failed_values.value


class _CountingStub:
    """Wraps a peer stub so that replies from that peer are counted as received bytes."""

    def __init__(self, stub, runner: ExactAllReduceRunner):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, requests: AsyncIterator[averaging_pb2.AveragingData]):
        replies = await self._stub.rpc_aggregate_part(requests)
        return self._runner._count_received(replies)


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose reducers hand out the average itself, not a delta."""

    def __init__(self, *args, traffic: _TrafficCounters, **kwargs):
        super().__init__(*args, **kwargs)
        # a failed reducer's part falls back to our own values rather than a zero delta
        self.tensor_part_container.return_deltas = False
        self.traffic = traffic

    async def _count_received(self, messages: AsyncIterator[averaging_pb2.AveragingData]):
        async for message in messages:
            self.traffic.add(recv=message.ByteSize())
            yield message

    def _get_peer_stub(self, peer: PeerID):
        return _CountingStub(super()._get_peer_stub(peer), self)

    async def _generate_input_for_peer(self, peer_index: int):
        async for message in super()._generate_input_for_peer(peer_index):
            self.traffic.add(sent=message.ByteSize())
            yield message

    async def _communicate_with_peer(self, peer_id: PeerID):
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        # our own share: reduce it locally and keep the average (the stock runner keeps a delta)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, part, weight=self.weight
            )
            self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)

    async def rpc_aggregate_part(self, stream, context: P2PContext):
        async for reply in super().rpc_aggregate_part(self._count_received(stream), context):
            self.traffic.add(sent=reply.ByteSize())
            yield reply

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        loop = asyncio.get_event_loop()
        parts_done = 0
        try:
            async for part, weight, codec in amap_in_executor(
                _decode_request, stream, max_prefetch=self.tensor_part_container.prefetch
            ):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, parts_done, part, weight=weight
                    )
                except BannedException:
                    break  # the sender was dropped from this round; stop serving it
                parts_done += 1
                serialized = await loop.run_in_executor(None, serialize_torch_tensor, averaged, codec)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if parts_done != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


def _decode_request(message: averaging_pb2.AveragingData):
    return deserialize_torch_tensor(message.tensor_part), message.weight, message.tensor_part.compression


class ExactAverager(DecentralizedAverager):
    """A ``DecentralizedAverager`` whose rounds leave every peer with identical tensors.

    It runs in its own process (as hivemind's does); the byte counts and the share of the vector
    whose reducer failed are passed back through ``traffic``, shared counters.
    """

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht, **kwargs):
        self.traffic = _TrafficCounters()
        self._shared_state: tuple[dict, torch.Tensor] | None = None
        super().__init__(averaged_tensors, dht, **kwargs)

    def share_state(self, metadata: dict, payload: bytes, *, priority: float) -> None:
        """Serve ``payload`` (with ``metadata``) to peers that download state; peers try the
        highest ``priority`` first. Replaces the previous snapshot atomically."""
        self._shared_state = (metadata, torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.state_sharing_priority = priority

    def get_current_state(self):
        # called in this (the host) process when a peer downloads our state; a snapshot taken at
        # the end of a round, never live tensors that the next outer step may be changing
        if self._shared_state is None:
            return {}, [], None
        metadata, payload = self._shared_state
        return metadata, [payload], None

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ):
        group_id = group_info.group_id if group_id is None else group_id
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            traffic=self.traffic,
            **kwargs,
        )
        assert group_id in self._running_groups, f"group {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
                async for _ in runner:
                    raise ValueError("auxiliary peers do not receive averaged tensors")
            else:
                async for tensor, averaged in azip(as_aiter(*tensors), runner):
                    tensor.copy_(averaged)
                self._state_updated.set()
        finally:
            self.traffic.add(failed_values=runner.tensor_part_container.failed_size)
