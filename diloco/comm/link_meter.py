"""A worker's measure of its link, and the codec it prefers for the next round
(``compression.name=adaptive``, compression/adaptive.py).

After each round the transport records the bytes the round moved (sent and received) and how
long the transfer took, from the moment the group began its all-reduce to its end (matchmaking's
wait is not the link's). Before the next round the worker prefers the least lossy candidate
whose bytes, at that throughput, move within ``compression.comm_budget`` of the time between its
rounds (its compute).

The first round prefers the most lossy codec: nothing is measured yet, and it fits any link. A
throughput measured on a small payload is pessimistic (latency weighs more), so while a round's
transfer took at most half its budget the next preference is at least one codec less lossy than
the last round's: the choice climbs a codec a round on a link that allows it, and falls at once
to what fits when the link slows down.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def preferred(self, *, numel: int, peers: int, between_rounds_s: float) -> int:
        """The index (into the candidates) of the codec to declare for the next round."""
        most_lossy = len(self.codecs.candidates) - 1
        if self.last is None:
            return most_lossy
        allowed_s = self.codecs.budget * between_rounds_s
        fits = next(
            (
                index
                for index, codec in enumerate(self.codecs.candidates)
                if round_bytes(codec, numel, peers) / self.throughput <= allowed_s
            ),
            most_lossy,
        )
        if self.last_transfer_s <= allowed_s / 2:  # room to spare: one codec less lossy at least
            fits = min(fits, max(0, self.last - 1))
        return fits
