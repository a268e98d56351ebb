"""A worker's measure of its link, and the codec it prefers for the next round
(``compression.name=adaptive``, compression/adaptive.py).

After each round the transport records the bytes the round moved (sent and received) and how
long the transfer took, from the moment the group began its all-reduce to its end (matchmaking's
wait is not the link's). Before the next round the worker prefers the least lossy candidate
whose bytes, at that throughput, move within ``compression.comm_budget`` of the time between its
rounds (its compute).

Before its first measured round a worker declares no preference: its group's measured peers
decide, and a group where nobody has measured yet (a run's first round) takes the most lossy
codec, which fits any link. A
throughput measured on a small payload is pessimistic (latency weighs more), so while a round's
transfer took at most half its budget, and the next less lossy codec is predicted within twice
it, the next preference is at least that codec: the choice climbs a codec a round on a link
that allows it, and falls at once to what fits when the link slows down. A round whose transfer
failed is measured too (its bytes over its time): a codec that cannot finish is not tried again
while the link stays as slow.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.comm.volume import sent_bytes
from diloco.compression.adaptive import Adaptive
from diloco.compression.codec import Codec


def round_bytes(codec: Codec, numel: int, peers: int) -> int:
    """What a worker sends and receives in a round among ``peers`` with ``codec`` (hivemind's
    butterfly, or an all-gather for a codec that ``gathers``: the simulator's payload model)."""
    return 2 * sent_bytes(codec.payload_bytes(numel), peers, gathers=codec.gathers)


@dataclass
class LinkMeter:
    codecs: Adaptive  # the candidates, and the budget (compression.comm_budget)
    last: int | None = None  # the index of the codec the last measured round used
    throughput: float = 0.0  # bytes a second the last measured round moved, sent and received
    last_transfer_s: float = 0.0

    def record(self, codec: Codec, moved_bytes: int, transfer_s: float) -> None:
        """A round's transfer: ``moved_bytes`` sent and received in ``transfer_s`` seconds with ``codec``."""
        if moved_bytes > 0 and transfer_s > 0:
            self.last = self.codecs.candidates.index(codec)
            self.throughput, self.last_transfer_s = moved_bytes / transfer_s, transfer_s

    def preferred(self, *, numel: int, peers: int, between_rounds_s: float) -> int | None:
        """The index (into the candidates) of the codec to declare for the next round; None before
        anything is measured (the worker then leaves the choice to its peers)."""
        most_lossy = len(self.codecs.candidates) - 1
        if self.last is None:
            return None
        allowed_s = self.codecs.budget * between_rounds_s

        def predicted(index: int) -> float:
            return round_bytes(self.codecs.candidates[index], numel, peers) / self.throughput

        fits = next((index for index in range(most_lossy + 1) if predicted(index) <= allowed_s), most_lossy)
        less_lossy = max(0, self.last - 1)
        if (
            self.last_transfer_s <= allowed_s / 2  # room to spare,
            and predicted(less_lossy) <= 2 * allowed_s  # and the measure, pessimistic, is not far off
        ):
            fits = min(fits, less_lossy)
        return fits


class CodecChoice:
    """What a worker prefers to send next round and what it says it used (``compression.name=
    adaptive``: its ``LinkMeter``); for a fixed codec, no preference."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.meter = LinkMeter(codec) if codec.chosen_per_round else None
        self._last_round_end = time.monotonic()  # the time from there to the next round is compute

    def preference(self, tensors: Sequence[torch.Tensor], *, peers: int) -> int | None:
        """The codec this worker prefers for its next round; None for a fixed codec, or before its
        link was measured."""
        if self.meter is None:
            return None
        between_rounds_s = time.monotonic() - self._last_round_end
        return self.meter.preferred(
            numel=sum(t.numel() for t in tensors), peers=peers, between_rounds_s=between_rounds_s
        )

    def measure(self, codec: Codec, moved_bytes: int, transfer_s: float) -> None:
        """A round's transfer, for the next preference."""
        if self.meter is not None:
            self.meter.record(codec, moved_bytes, transfer_s)

    def named(self, codec: Codec) -> str:
        """What a round's result says of its codec: its label where it was agreed per round."""
        return codec.label if self.codec.chosen_per_round else ""

    def round_ended(self) -> None:
        self._last_round_end = time.monotonic()
