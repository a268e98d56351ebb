"""A reducer's side of the bit-exact all-reduce (``exact_allreduce.py``): the senders of our
share served.

Each sender streams us its parts of our share; each is checked and decoded once (a bad payload, a
weight other than the declared one, parts longer than the declared norm drop that sender, with a
log line; ``screening.py``), scaled by the screening's factor and summed by our reducer
(``reducer.py``). Every sender, and our own share, then takes the same reply of each part: its
average compressed once (``_reply``), or with a codec that gathers (top-k), the kept senders'
payloads of the part, from which each takes their mean itself (``_gathered``, ``gathered.py``).
Every reply carries the number of contributions the part was averaged over, and every byte of the
exchange is counted (``traffic.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math

import torch
from hivemind.averaging.partition import BannedException
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from diloco.comm.hivemind import gathered
from diloco.comm.hivemind.screening import check_declared_norm, check_declared_weight
from diloco.comm.hivemind.wire import bytes_part, compress_reply, decode_part
from diloco.compression import PayloadError

logger = logging.getLogger(__name__)


class ShareReducing:
    """A mix-in of ``ExactAllReduceRunner``: hivemind's ``rpc_aggregate_part`` and
    ``_accumulate_parts_streaming`` for our share, with the replies they send."""

    async def _reply(self, part_index: int, averaged: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """The compressed average of one part of our share, made once (every sender and our own
        share await the same future) and sent to every sender, and what it decodes to, which we
        keep ourselves. Raises PayloadError if the average is not finite."""
        if part_index not in self._replies:  # no await between the test and the set: one future per part
            self._replies[part_index] = asyncio.get_event_loop().run_in_executor(
                None, compress_reply, self.codec.reply_codec, averaged
            )
        reply = await self._replies[part_index]
        self._replies_taken[part_index] += 1
        if self._replies_taken[part_index] >= self._reply_takers:  # every sender has it: not held to the round's end
            self._replies.pop(part_index, None)
        return reply

    async def _gathered(self, part_index: int, numel: int) -> tuple[list[gathered.Kept], torch.Tensor]:
        """A codec that gathers: the contributions kept for one part of our share (those our
        reducer's screening kept), as every sender reads them, and their mean, which we keep
        ourselves (made once, once the part is complete). Raises PayloadError if the mean is not finite."""
        if part_index not in self._replies:  # no await between the test and the set: one future per part
            screened = self.tensor_part_reducer.kept_in(part_index)
            sent = self._kept.get(part_index, {})
            kept = gathered.as_received([k for s, k in sent.items() if screened is None or s in screened])
            self._replies[part_index] = asyncio.get_event_loop().run_in_executor(
                None, lambda: (kept, gathered.mean(self.codec, kept, numel, self._scales_by_sender))
            )
        return await self._replies[part_index]

    @property
    def _scales_by_sender(self) -> list[float]:
        """The screening's factor of each sender, by sender index (the same on every peer)."""
        return [self.screening.scales.get(peer, 1.0) for peer in self.sender_peer_ids]

    async def rpc_aggregate_part(self, stream, context: P2PContext):
        self.traffic.serving(+1)
        try:
            async for reply in super().rpc_aggregate_part(self._count_received(stream), context):
                self.traffic.add(sent=reply.ByteSize())
                yield reply
        finally:
            self.traffic.serving(-1)

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        loop = asyncio.get_event_loop()
        reducer, sender = self.tensor_part_reducer, self.sender_peer_ids[sender_index]
        scale = self.screening.scales.get(sender)
        parts_done = 0
        try:
            if scale is None:  # dropped by the screening (logged when the round started)
                return
            async for message in stream:
                try:
                    if not (math.isfinite(message.weight) and message.weight > 0):
                        raise PayloadError(f"weight {message.weight} is not a positive number")
                    check_declared_weight(self.weights, sender, message.weight)
                    weight = self.screening.weight(message.weight)  # a claim above the round's bound is cut
                    numel = reducer.part_shapes[parts_done].numel() if parts_done < reducer.num_parts else -1
                    part = await loop.run_in_executor(None, decode_part, self.codec, message.tensor_part, numel)
                    check_declared_norm(self._received_squares, self.norms, sender, part)
                    if scale != 1.0:
                        part = part * scale
                except PayloadError as error:
                    logger.warning("dropped the contribution of peer %s: %s", sender, error)
                    self.payload_dropped[sender] = str(error)
                    break
                if self.codec.gathers:  # what the others take this part's mean from
                    self._kept.setdefault(parts_done, {})[sender_index] = gathered.Kept(
                        sender_index, weight, bytes(message.tensor_part.buffer)
                    )
                try:
                    averaged = await reducer.accumulate_part(sender_index, parts_done, part, weight=weight)
                except BannedException:
                    # the sender was dropped from this round (too late, say): not in the part's
                    # gathered mean either (the part waits for it until this raises); stop serving it
                    self._kept.get(parts_done, {}).pop(sender_index, None)
                    break
                if self.codec.gathers:
                    kept, _ = await self._gathered(parts_done, part.numel())
                    payload = gathered.pack(kept, recipient=sender_index)
                else:
                    payload, _ = await self._reply(parts_done, averaged)
                # over how many contributions this part was averaged, for the senders' round records
                contributions = float(reducer.contributions.get(parts_done, 0))
                parts_done += 1
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART, tensor_part=bytes_part(payload), weight=contributions
                )
        finally:
            if parts_done != reducer.num_parts:
                await self._ban_sender(sender)
