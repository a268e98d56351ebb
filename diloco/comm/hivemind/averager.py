"""hivemind's decentralized averager, changed so that every peer ends a round bit-identical.

Stock hivemind (1.1.12) runs a butterfly all-reduce in which each peer reduces one part of the
vector and sends every sender back ``average - what_you_sent``; the sender adds that delta to
its own part. ``x + (avg - x)`` is not ``avg`` in floating point, so peers drift apart by an
ulp per round and their parameter hashes never agree. Here a reducer returns the averaged part
itself, the peers copy it in, and the reducer keeps exactly the values it sent. The same rule
makes lossy codecs safe: whatever a reducer sends is what everyone, itself included, uses.

Parts travel compressed by the run's codec (diloco/compression): a sender compresses each part
of its pseudo-gradient, the reducer checks and decodes every part it receives (a bad payload
drops that sender, with a log line), averages in fp32, compresses the average once and sends
those bytes to every sender, and uses what they decode to for its own share. Part boundaries
fall on multiples of the codec's block, so a part's payload is the same bytes the worker's
error feedback computed for it. A codec that ``gathers`` (top-k) is not averaged by the reducer:
it sends each sender the other kept senders' payloads of the part, and every peer takes their
mean itself (gathered.py).

The runner also counts the bytes of every averaging message it sends and receives, so a round
reports traffic measured on the wire rather than estimated.

Robust aggregation (``robust.py``): a reducer sees only a slice of each sender's vector, so each
sender declares the norm of its whole (decoded) contribution in the matchmaking's gathered data.
Every peer screens the same declared norms alike: a dropped sender is refused by every reducer
(banned before it sends anything, so nobody waits for it), and drops itself as it would a payload
it cannot decode; with ``comm.clip_to_median`` every reducer scales a sender's parts by the same
factor. A reducer checks what it receives against the declared norm (the parts of a vector cannot
be longer than the vector) and drops a sender that under-declared, or whose parts claim another
weight than it declared (the screening's weight bound and free-rider rule judged the declared
one). By direction, and the senders its tally excludes, each reducer screens the parts of its
share (``reducer.ScreeningReducer``); with a codec that gathers, it sends only the payloads of the
senders it kept.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import io
import logging
import math
import multiprocessing as mp
import signal
import time
import typing
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import BannedException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import (
    achain,
    aiter_with_timeout,
    amap_in_executor,
    as_aiter,
    attach_event_on_finished,
    azip,
)
from hivemind.utils.mpfuture import MPFuture

from diloco.comm.base import StateReader
from diloco.comm.hivemind import gathered, gloo_plane
from diloco.comm.hivemind.exclusion import Exclusions
from diloco.comm.hivemind.forked import release_inherited_tensors
from diloco.comm.hivemind.reducer import ScreeningReducer, reducer_for
from diloco.comm.hivemind.run_key import keyed_schema_hash
from diloco.comm.hivemind.state_download import StateDownload
from diloco.comm.robust import (
    NO_SCREENING,
    Screening,
    ScreeningRules,
    declared_norm,
    declared_weights,
    screen,
)
from diloco.compression import PAYLOAD_FORMAT, Codec, PayloadError, all_finite
from diloco.lifetime import die_with_parent, shielded_from_interrupts

logger = logging.getLogger(__name__)


_NOT_SEEN = 1 << 40


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
        self._own_drops = mp.Value(ctypes.c_int64, 0)
        self._serving = mp.Value(ctypes.c_int64, 0)  # senders this peer is still streaming averaged parts to
        self._least = mp.Value(ctypes.c_int64, _NOT_SEEN)  # the fewest contributions in a part of this round
        self._most = mp.Value(ctypes.c_int64, 0)  # the most
        self._transfer_us = mp.Value(ctypes.c_int64, 0)  # time in all-reduces, from the group's start to our end
        self._codec = mp.Value(ctypes.c_int64, 0)  # the candidate the last all-reduce used (codec.candidates)
        self._left_behind = mp.Value(ctypes.c_int64, 0)  # groups that broke for a member that had left them
        self._lost_reducers = mp.Value(ctypes.c_int64, 0)  # other members whose averaged parts never all came

    def add(
        self,
        *,
        sent: int = 0,
        recv: int = 0,
        failed_values: int = 0,
        own_drops: int = 0,
        lost_reducers: int = 0,
        transfer_s: float = 0.0,
    ) -> None:
        for counter, amount in (
            (self._sent, sent),
            (self._recv, recv),
            (self._failed_values, failed_values),
            (self._own_drops, own_drops),
            (self._lost_reducers, lost_reducers),
            (self._transfer_us, round(transfer_s * 1e6)),
        ):
            if amount:
                with counter.get_lock():
                    counter.value += amount

    def note_contributions(self, count: int) -> None:
        """A part of this round's mean (ours or a reducer's) was averaged over ``count`` contributions."""
        with self._least.get_lock():
            self._least.value = min(self._least.value, count)
            self._most.value = max(self._most.value, count)

    def take_contributions(self) -> tuple[int, int] | None:
        """The fewest and the most contributions the parts of the round since the last call were
        averaged over (None: no part said), and start counting afresh."""
        with self._least.get_lock():
            least, most = self._least.value, self._most.value
            self._least.value, self._most.value = _NOT_SEEN, 0
        return None if least == _NOT_SEEN else (least, most)

    def serving(self, change: int = 0) -> int:
        """Reply streams to senders still open (after adding ``change``). A peer whose own round is
        over may still be sending a sender its averaged parts: it must not shut down before."""
        with self._serving.get_lock():
            self._serving.value += change
            return self._serving.value

    def used_codec(self, index: int | None = None) -> int:
        """The index (in ``Codec.candidates``) of the codec the last all-reduce used, after setting it."""
        if index is not None:
            self._codec.value = index
        return self._codec.value

    def groups_left_behind(self, change: int = 0) -> int:
        """Groups so far (after adding ``change``) that broke because a member had given up on them
        before they formed (its leader's answer came late): we refused their parts
        (``ExactAverager.rpc_aggregate_part``), or a reducer refused ours. Their peers retry. Only a
        member that reduces a share over hivemind refuses: a late client, or a group averaged over
        the gloo data plane, fails as any broken group does."""
        with self._left_behind.get_lock():
            self._left_behind.value += change
            return self._left_behind.value

    def reducers_lost(self) -> int:
        """Other members of our groups so far whose averaged parts never all came back to us inside
        an all-reduce: a member that crashed or was cut off from us (or stalled past its timeout,
        or sent what we could not read), counted once its all-reduce is over. A retry among the
        survivors expects that many fewer (``averaging.py``)."""
        return self._lost_reducers.value

    def transfer_s(self) -> float:
        """Seconds spent in all-reduces so far (the link's share of the rounds: comm/link_meter.py)."""
        return self._transfer_us.value / 1e6

    def read(self) -> tuple[int, int, int, int]:
        """(bytes sent, bytes received, values whose reducer failed, rounds in which our own
        reducer refused our contribution: the others did too) so far."""
        return self._sent.value, self._recv.value, self._failed_values.value, self._own_drops.value


def check_declared_weight(declared: Mapping, sender: object, weight: float) -> None:
    """Raise PayloadError when ``sender``'s part claims another weight than it declared at
    matchmaking (``declared``: sender -> weight), the one every peer's screening judged alike; a
    sender that declared none claims another. Nothing when no weights were declared at all."""
    if declared and not weight == declared.get(sender, math.nan):
        raise PayloadError(f"its parts claim weight {weight:g}, not the {declared.get(sender, math.nan):g} it declared")


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose reducers hand out the average itself, not a delta."""

    def __init__(
        self,
        *args,
        traffic: _TrafficCounters,
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
        self.tensor_part_reducer = reducer_for(shapes, senders, self.screening.min_cosine, excluded=excluded)
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

    def _check_declared_norm(self, sender: PeerID, part: torch.Tensor) -> None:
        """Raise PayloadError once the parts of ``sender`` received here are longer than the norm it
        declared for its whole vector (10% for rounding, and a tiny absolute slack)."""
        squares = self._received_squares.get(sender, 0.0) + float(torch.linalg.vector_norm(part)) ** 2
        self._received_squares[sender] = squares
        declared = self.norms.get(sender, math.nan)
        if not math.sqrt(squares) <= 1.1 * declared + 1e-6:
            raise PayloadError(f"its parts have norm {math.sqrt(squares):.4g}, above the {declared:.4g} it declared")

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
            message = averaging_pb2.AveragingData(tensor_part=_bytes_part(payload), weight=self.weight)
            if first:
                message.code, message.group_id, first = averaging_pb2.PART_FOR_AVERAGING, self.group_id, False
            self.traffic.add(sent=message.ByteSize())
            yield message

    async def _reply(self, part_index: int, averaged: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """The compressed average of one part of our share, made once (every sender and our own
        share await the same future) and sent to every sender, and what it decodes to, which we
        keep ourselves. Raises PayloadError if the average is not finite."""
        if part_index not in self._replies:  # no await between the test and the set: one future per part
            self._replies[part_index] = asyncio.get_event_loop().run_in_executor(
                None, _compress_reply, self.codec.reply_codec, averaged
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

    def _gathered_mean(self, serialized: runtime_pb2.Tensor, numel: int, own: bytes | None) -> torch.Tensor:
        """A reducer's gathered reply to us, read as it reads it: the mean of the kept payloads."""
        if serialized.dtype != "uint8" or serialized.compression != runtime_pb2.CompressionType.NONE:
            raise PayloadError(f"payload is a {serialized.dtype} tensor, not the bytes of a gathered reply")
        if numel < 0:
            raise PayloadError("more parts than this peer reduces")
        me = self.sender_peer_ids.index(self.peer_id)
        kept = gathered.unpack(serialized.buffer, recipient=me, own=own)
        return gathered.mean(self.codec, kept, numel, self._scales_by_sender)

    @property
    def _scales_by_sender(self) -> list[float]:
        """The screening's factor of each sender, by sender index (the same on every peer)."""
        return [self.screening.scales.get(peer, 1.0) for peer in self.sender_peer_ids]

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
                    payload, sent = await loop.run_in_executor(None, _compressed_as_sent, self.codec, part)
                    self._kept.setdefault(part_index, {})[sender_index] = gathered.Kept(sender_index, weight, payload)
                else:
                    sent = await loop.run_in_executor(None, _as_sent, self.codec, part)
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
                        part = await loop.run_in_executor(None, _decode_part, self.codec, message.tensor_part, numel)
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
                    part = await loop.run_in_executor(None, _decode_part, self.codec, message.tensor_part, numel)
                    self._check_declared_norm(sender, part)
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
                    code=averaging_pb2.AVERAGED_PART, tensor_part=_bytes_part(payload), weight=contributions
                )
        finally:
            if parts_done != reducer.num_parts:
                await self._ban_sender(sender)


def _log_left_out(runner: ExactAllReduceRunner) -> None:
    """One line per sender our reducer left out of parts of our share (``comm.min_cosine``)."""
    reducer = runner.tensor_part_reducer
    if not isinstance(reducer, ScreeningReducer):
        return
    for index, reasons in sorted(reducer.left_out.items()):
        peer = runner.sender_peer_ids[index]
        logger.warning(
            "left the contribution of peer %s out of %d of the %d parts we reduced: %s",
            peer, len(reasons), reducer.num_parts, reasons[0],
        )  # fmt: skip


def _bytes_part(payload: bytes) -> runtime_pb2.Tensor:
    """A payload as hivemind's tensor message (uint8, uncompressed: the codec has done the work)."""
    return runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.NONE, buffer=payload, size=[len(payload)], dtype="uint8"
    )


def _compress_reply(codec: Codec, averaged: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    payload = codec.compress(averaged)
    if codec.lossless:  # what the senders decode is these very values: no need to decode them here
        if not all_finite(averaged):
            raise PayloadError("payload decodes to non-finite values (NaN or inf)")
        return payload, averaged
    return payload, codec.decompress(payload, averaged.numel())


def _compressed_as_sent(codec: Codec, part: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """Our own part's payload, and what a reducer decodes it to."""
    payload = codec.compress(part)
    return payload, codec.decompress(payload, part.numel())


def _as_sent(codec: Codec, part: torch.Tensor) -> torch.Tensor:
    """Our own part as a reducer would decode it (``codec.roundtrip``; a lossless codec's is the part)."""
    if codec.lossless:
        if not all_finite(part):
            raise PayloadError("payload decodes to non-finite values (NaN or inf)")
        return part
    return codec.roundtrip(part)


def _decode_part(codec: Codec, serialized: runtime_pb2.Tensor, numel: int) -> torch.Tensor:
    if serialized.dtype != "uint8" or serialized.compression != runtime_pb2.CompressionType.NONE:
        raise PayloadError(f"payload is a {serialized.dtype} tensor, not the bytes of a compressed part")
    if numel < 0:
        raise PayloadError("more parts than this peer reduces")
    return codec.decompress(serialized.buffer, numel)


# hivemind cuts each reducer's share into parts and a reducer answers part k only once every
# sender's part k is in: on slow links the last part's replies are a tail nothing overlaps, so
# small parts pay there (testbed, 4 peers at 20 Mbit/s, fp32, all-reduce efficiency: 10 MB 0.753
# at 512 KiB parts -> 0.802 at 64 KiB, 40 MB 0.722 -> 0.784; 2 MiB 0.61). Every part also costs a
# fixed amount of work (messages, executor hops), which dominates on fast links with large
# payloads (85M fp32 values, 2 peers on loopback: 11.5 s a round at 64 KiB parts, 6.1 s at
# 512 KiB, 4.6 s at 2 MiB). So a payload is cut into about ``PARTS_PER_PAYLOAD`` parts, each
# between ``MIN_PART_WIRE_BYTES`` and ``MAX_PART_WIRE_BYTES`` on the wire: its tail is then at most
# a few percent of the round whatever the link. Sized on the wire, so a compressed part is no
# smaller and its framing stays negligible.
MIN_PART_WIRE_BYTES = 64 * 1024
MAX_PART_WIRE_BYTES = 4 * 1024 * 1024
PARTS_PER_PAYLOAD = 128


def aligned_part_size_bytes(codec: Codec, total_values: int = 0) -> int:
    """hivemind's part size, in fp32 bytes (it cuts parts of size / 4 values from each tensor's
    start) for a payload of ``total_values``: about 1/``PARTS_PER_PAYLOAD`` of it once compressed,
    within the bounds above, a multiple of the codec's block so that no block straddles two parts."""
    sample = 1 << 20
    wire_bytes_per_value = codec.payload_bytes(sample) / sample
    wire_bytes = min(
        MAX_PART_WIRE_BYTES, max(MIN_PART_WIRE_BYTES, total_values * wire_bytes_per_value / PARTS_PER_PAYLOAD)
    )
    values = max(1, round(wire_bytes / wire_bytes_per_value) // codec.align) * codec.align
    return 4 * values


class ExactAverager(StateDownload, DecentralizedAverager):
    """A ``DecentralizedAverager`` whose rounds leave every peer with identical tensors.

    It runs in its own process (as hivemind's does); the byte counts and the share of the vector
    whose reducer failed are passed back through ``traffic``, shared counters.
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht,
        *,
        codec: Codec,
        run_key: str = "",
        rules: ScreeningRules = NO_SCREENING,
        standings: Path | None = None,
        start: bool,
        **kwargs,
    ):
        self.traffic, self.codec = _TrafficCounters(), codec
        self._refused_groups: collections.deque[bytes] = collections.deque(maxlen=64)  # counted once each
        self.rules = rules
        # comm.exclude_after, across this peer's rounds (saved to ``standings``, read back on a restart)
        self.exclusions = Exclusions(rules.exclude_after, standings, readmit_after=rules.readmit_after)
        self._shared_state: tuple[dict, StateReader] | None = None
        self._serve_parts()  # the parts of our state that peers download (state_download.py)
        super().__init__(
            averaged_tensors,
            dht,
            part_size_bytes=aligned_part_size_bytes(codec, sum(t.numel() for t in averaged_tensors)),
            start=False,
            **kwargs,
        )
        # a join request must present the leader's schema hash: keyed, only run-key holders can;
        # only peers of the same payload format can join; a codec that gathers replies in another
        # format (gathered.py): only its like can join, and a codec chosen per round only peers of
        # the same candidates
        schema = self.schema_hash + PAYLOAD_FORMAT
        schema += gathered.FORMAT if any(c.gathers for c in codec.candidates) else b""
        if codec.chosen_per_round:  # peers agree on a codec by index: only those of the same candidates
            schema += codec.describe().encode()
        self.schema_hash = keyed_schema_hash(run_key, schema)
        if start:
            self.run_in_background(await_ready=True)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        # hivemind's own sets SIGINT to SIG_IGN in the worker and leaves it so: Ctrl-C did nothing
        with shielded_from_interrupts():
            self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    def run(self):
        # in the averager's own process: it dies with the worker, however the worker dies (lifetime.py)
        die_with_parent(signal.SIGKILL, parent_pid=self._parent_pid)
        release_inherited_tensors()  # the worker's model, forked with us: we read only the shared buffers
        logging.getLogger("hivemind.averaging.averager").addFilter(drop_expected_step_failures)
        logging.getLogger("asyncio").addFilter(drop_result_of_a_cancelled_step)
        super().run()

    def set_group(self, group_bits: str, *, target_group_size: int, timeout_s: float) -> None:
        """Match the next round under ``group_bits``, starting it as soon as ``target_group_size`` peers
        are in. Raises ``TimeoutError`` if the averager's process does not take it within ``timeout_s``."""
        sent = dict(group_bits=group_bits, target_group_size=target_group_size)
        ask_within(self._outer_pipe, "_set_group", sent, timeout_s=timeout_s, what="the round's group key")

    def tensors_within(self, timeout_s: float):
        """``get_tensors()``, waiting at most ``timeout_s`` for the averager to release them (it holds
        them through an all-reduce, one given up on included); raises ``TimeoutError`` past it."""
        return held_within(self.lock_averaged_tensors, self._averaged_tensors, timeout_s)

    async def _set_group(self, group_bits: str, target_group_size: int, future: MPFuture):
        try:
            matchmaking = self._matchmaking
            matchmaking.group_key_manager.group_bits = group_bits
            # the next key is set here every round: hivemind's own key update must not fail on a
            # group bigger than it planned for (a worker joined), so it sizes by the group instead
            matchmaking.group_key_manager.target_group_size = None
            matchmaking.target_group_size = target_group_size
            matchmaking.potential_leaders.target_group_size = target_group_size
            future.set_result(None)
        except Exception as error:
            if not future.done():
                future.set_exception(error)

    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:  # typing's: hivemind reads the handler's kind from them
        # hivemind holds a part for a group it does not know until its own matchmaking ends: right
        # when the leader's answer to us is merely late, but a leader can also count us in a group
        # we had given up on (its answer came past our request's timeout), and then every sender
        # waits its whole reducer timeout for our share while we look for a group all round. Once
        # we follow no leader and hold no group, past a bound, we answer that the group is not ours
        # and the others go on without us at once.
        request = await anext(stream)
        matchmaking = self._matchmaking
        if not await group_registered(
            request.group_id,
            self._running_groups,
            self._pending_groups_registered,
            UNKNOWN_GROUP_WAIT * self.request_timeout,
            joining=lambda: matchmaking.current_leader is not None or matchmaking.assembled_group.done(),
        ):
            logger.warning(
                "peer %s sent a part for a group we are not in (a leader counted us in after we left it): refused",
                context.remote_id,
            )
            if request.group_id not in self._refused_groups:  # each of its senders asks: one group
                self._refused_groups.append(request.group_id)
                self.traffic.groups_left_behind(+1)  # our round stops looking for a group and retries (averaging.py)
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    def share_state(self, metadata: dict, state: StateReader, *, priority: float) -> None:
        """Serve the state ``state`` reads (with ``metadata``) to peers that download state; peers
        try the highest ``priority`` first. It is read and serialized only when a peer asks, under
        the outer step's lock; once stale (an outer step changed it) nothing is served until the
        next offer. Replaces the previous one atomically."""
        self._shared_state = (metadata, state)
        self.state_sharing_priority = priority

    def get_current_state(self):
        # called in this (the host) process, on a thread of hivemind's, when a peer downloads our state
        if self._shared_state is None:
            return {}, [], None
        metadata, read = self._shared_state
        serialized = read(serialize_state)
        if serialized is None:  # an outer step changed the state since it was offered
            return {}, [], None
        return metadata, [torch.frombuffer(serialized.getbuffer(), dtype=torch.uint8)], None

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ):
        group_id = group_info.group_id if group_id is None else group_id
        declared, modes = self._user_data(group_info)
        codec = self.codec.agreed(declared.values())  # the round's (compression/adaptive.py)
        self.traffic.used_codec(self.codec.candidates.index(codec))
        if gloo_plane.carries(codec, list(declared.values())):
            # the workers average this group's vectors through the data plane, not through us
            self._running_groups[group_id].set_result(None)
            return
        norms = {peer: declared_norm(data) for peer, data in declared.items()}
        screening = screen(norms, self.rules, declared_weights(declared))  # the same on every peer
        excluded = self.exclusions.of(declared, own=self.peer_id)  # then the peers our tally excludes
        screening = self.exclusions.screened(screening, excluded)
        for peer, reason in screening.dropped.items():
            if peer == self.peer_id:
                logger.warning("dropped our own contribution: %s", reason)
            else:
                logger.warning("dropped the contribution of peer %s: %s", peer, reason)
        started = time.monotonic()
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            modes=modes,
            traffic=self.traffic,
            codec=codec,
            screening=screening,
            norms=norms,
            weights=declared_weights(declared),
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
            self.exclusions.record(runner.sender_peer_ids, screening, excluded, runner, own=self.peer_id)
        finally:
            self.traffic.add(
                failed_values=runner.tensor_part_container.failed_size,
                lost_reducers=runner.lost_reducers,
                transfer_s=time.monotonic() - started,
            )
            _log_left_out(runner)

    def _user_data(self, group_info: GroupInfo) -> tuple[dict[PeerID, dict], tuple[AveragingMode, ...]]:
        """What each peer that contributes gathered at matchmaking (as hivemind's own
        ``_aggregate_with_group`` decodes it: [bandwidth, mode, user data]; an empty dict where
        unreadable: its norm is nan), helpers left out; and every peer's mode. hivemind 1.1.12 does
        not hand the modes to its runner, which then takes a helper (an auxiliary peer) for a sender."""
        found, modes = {}, []
        for peer, declared in zip(group_info.peer_ids, group_info.gathered):
            _, mode, user_data = self.serializer.loads(declared)  # hivemind itself read it so far
            modes.append(AveragingMode(mode))
            if modes[-1] == AveragingMode.AUX:
                continue
            try:
                found[peer] = self.serializer.loads(user_data)
            except Exception:  # whatever a peer put there, it is not usable
                found[peer] = {}
        return found, tuple(modes)


# how many of hivemind's request timeouts a part for a group we do not know waits for us to
# register that group (the leader's answer to us on its way), before we refuse it
UNKNOWN_GROUP_WAIT = 2
_JOINING_POLL_S = 0.25  # how often a wait past its bound asks whether we are still joining a group


async def group_registered(
    group_id: bytes,
    running: Mapping[bytes, asyncio.Future],
    registered: asyncio.Event,
    timeout_s: float,
    *,
    joining: Callable[[], bool] = lambda: False,
) -> bool:
    """Whether ``group_id`` is among the ``running`` groups, or is registered before we give up:
    hivemind clears ``registered`` while matchmaking and sets it once a group is registered (or
    given up). We give up past ``timeout_s`` once ``joining()`` is false (we follow no leader and
    hold no assembled group: a group that counts us in is not one we can still register)."""
    if group_id in running:
        return True
    deadline = time.monotonic() + timeout_s
    while not registered.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not joining():
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(registered.wait(), remaining if remaining > 0 else _JOINING_POLL_S)
    return group_id in running


def drop_expected_step_failures(record: logging.LogRecord) -> bool:
    """A logging filter for hivemind's averager: it logs a failed step's exception with its
    traceback, then hands the exception to the step's caller, and the worker reports the round's
    failure in one line with the exception's message (core/outer.py). hivemind's record of an
    expected failure (no group found, a group that broke up) is left out; any other stays."""
    return not (record.exc_info and isinstance(record.exc_info[1], (AllreduceException, MatchmakingException)))


def drop_result_of_a_cancelled_step(record: logging.LogRecord) -> bool:
    """A logging filter for asyncio in the averager's process: a step the worker stopped waiting
    for (``GroupRound.await_step`` cancels it) may still end inside hivemind, whose task then fails
    to set the cancelled step's result, and asyncio logs that with a traceback. The worker has
    reported the round already; any other record stays."""
    error = record.exc_info[1] if record.exc_info else None
    return not (isinstance(error, concurrent.futures.InvalidStateError) and "CANCELLED" in str(error))


def serialize_state(state: dict) -> io.BytesIO:
    """A worker's state as ``torch.save`` writes it: what a peer that downloads it receives."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer


def ask_within(pipe, method: str, kwargs: dict, *, timeout_s: float, what: str) -> None:
    """Have the averager's process run ``method(**kwargs, future=...)`` through ``pipe``; raises
    ``TimeoutError`` naming ``what`` if it has not done so within ``timeout_s``."""
    future = MPFuture()
    pipe.send((method, [], dict(kwargs, future=future)))
    try:
        future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"the averager did not take {what} within {timeout_s:.0f} s") from None


@contextlib.contextmanager
def held_within(lock, tensors: list, timeout_s: float):
    """``tensors`` under ``lock`` (the averager's, shared with its process), waiting at most
    ``timeout_s`` for it; raises ``TimeoutError`` past it."""
    if not lock.acquire(timeout=timeout_s):
        raise TimeoutError(f"the averager held its tensors for more than {timeout_s:.0f} s (an earlier all-reduce)")
    try:
        yield tensors
    finally:
        lock.release()
