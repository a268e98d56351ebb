"""Compression chosen per round to fit the link: ``compression.name=adaptive``.

``Adaptive`` holds the candidate codecs, least lossy first (``compression.adaptive_codecs``:
none, fp16, int8, int4, topk; ``topk`` stands for a ladder of top-k codecs, most values first, so
a link too slow for int4 still sends as many values as fit). Before each round every worker says
which one it prefers (the transport measures its link: comm/link_meter.py); the peers of a round
declare their preferences when the group forms, and the group takes the most lossy of them
(``Adaptive.agreed``): the slowest link decides, and every peer computes the same choice from
the same declarations, so a round never mixes codecs.

Error feedback cannot know the round's codec before the round (``ErrorFeedback`` keeps the
corrected tensors and settles what was not sent once the round says which codec it used).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from diloco.compression.codec import Codec


class Adaptive(Codec):
    """A codec chosen per round among ``candidates`` (least lossy first). It makes no payload
    itself: a transport asks ``agreed`` for the round's codec and uses that one."""

    name, codec_id = "adaptive", 0
    chosen_per_round = True

    def __init__(self, candidates: Sequence[Codec], *, budget: float):
        if not candidates:
            raise ValueError("an adaptive codec needs at least one candidate")
        self._candidates = tuple(candidates)
        self.budget = (
            budget  # compression.comm_budget: a round's transfer may take this share of the time between rounds
        )
        self.align = math.lcm(*(c.align for c in self._candidates))

    @property
    def candidates(self) -> tuple[Codec, ...]:
        return self._candidates

    def agreed(self, declarations: Iterable[object]) -> Codec:
        """The round's codec from what its peers declared at matchmaking (each a dict whose
        ``"codec"`` is the index of its preference): the most lossy of them. What is not a
        candidate's index, or not a dict, is ignored; with nothing valid, the most lossy."""
        valid = [
            d["codec"]
            for d in declarations
            if isinstance(d, dict)
            and isinstance(d.get("codec"), int)
            and not isinstance(d["codec"], bool)
            and 0 <= d["codec"] < len(self.candidates)
        ]
        return self.candidates[max(valid) if valid else len(self.candidates) - 1]

    def named(self, label: str) -> Codec:
        """The candidate whose ``label`` is ``label`` (a round's result names the codec it used)."""
        for codec in self.candidates:
            if codec.label == label:
                return codec
        raise ValueError(f"{label!r} is not one of the adaptive codecs {[c.label for c in self.candidates]}")

    def body_bytes(self, numel: int) -> int:  # the least lossy's: what a part is sized for
        return self.candidates[0].body_bytes(numel)

    def _encode(self, flat: torch.Tensor) -> bytes:
        raise TypeError("an adaptive codec compresses with the round's agreed codec (Adaptive.agreed)")

    def _decode(self, body: memoryview, numel: int) -> torch.Tensor:
        raise TypeError("an adaptive codec decompresses with the round's agreed codec (Adaptive.agreed)")

    def describe(self) -> str:
        return "adaptive(" + ", ".join(c.describe() for c in self.candidates) + ")"
