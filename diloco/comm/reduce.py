"""The reduce rule every transport follows: decode each worker's compressed contribution, drop
the unusable ones, screen the rest by their norms, take the weighted mean, and restore it as the
codec replies with it. The simulator and torch.distributed apply it to whole vectors; hivemind's
reducers apply the same rule part by part (``hivemind/exact_allreduce.py``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from diloco.comm import sketch
from diloco.comm.robust import NO_SCREENING, ScreeningRules, norm_of, screen
from diloco.comm.verdicts import SketchHistory
from diloco.compression import Codec, PayloadError, all_finite

logger = logging.getLogger(__name__)


@dataclass
class Verdicts:
    """Who a round left out (and why) and whose contribution it scaled down: the tally of
    ``comm/scores.py``. Filled in by ``average_payloads`` when one is handed to it."""

    left_out: dict[str, str] = field(default_factory=dict)  # sender -> reason
    clipped: set[str] = field(default_factory=set)


@dataclass
class Contribution:
    """One worker's compressed tensors (one payload each) and its weight, as a reducer receives them."""

    worker: str  # who sent it, for the log
    payloads: Sequence[bytes]
    weight: float


def average_payloads(
    codec: Codec,
    contributions: Sequence[Contribution],
    numels: Sequence[int],
    *,
    round_index: int,
    rules: ScreeningRules = NO_SCREENING,
    verdicts: Verdicts | None = None,
    history: SketchHistory | None = None,
) -> tuple[list[torch.Tensor], list[Contribution]]:
    """The rule every transport follows to average compressed tensors (``codec`` decodes them).

    Each contribution is decoded (one with an invalid payload or weight is dropped, with a log line
    that names the sender and the reason); the decoded contributions are screened by their norms
    and weights as ``rules`` say (``robust.screen``: one far above the median is dropped, with
    ``clip_to_median`` those above it are scaled down to it, a weight counts for at most
    ``max_weight_ratio`` x the median), then by their sketches (``verdicts.py``: one that points
    against the others' median, or repeats a round of ``history``); the weighted mean is taken in
    fp32, in the order given; and the result is what ``codec`` restores from the compressed mean. That
    last step is what a reducer sends back, so a reducer that uses it for itself ends identical to
    the peers it serves (a codec that ``gathers`` is not compressed again: its ``gathered_mean``,
    checked to be finite). Returns the flat averaged tensors and the contributions that were used
    (none when nothing, or no usable average, came of them); ``verdicts``, if given, is told who was
    left out and why, and who was clipped. hivemind's reducers follow the same rule part by part
    (their sum runs in arrival order, so they agree with the simulator to rounding, not bit for bit).
    """
    verdicts = verdicts if verdicts is not None else Verdicts()
    decoded, used = _decoded(codec, contributions, numels, verdicts, round_index)
    decoded, used = _screened(decoded, used, rules, verdicts, round_index, history)
    if not used:
        return [], []
    means = _means(codec, decoded, used, numels, round_index)
    return (means, used) if means is not None else ([], [])


def _decoded(
    codec: Codec, contributions: Sequence[Contribution], numels: Sequence[int], verdicts: Verdicts, round_index: int
) -> tuple[list[list[torch.Tensor]], list[Contribution]]:
    """Each contribution's tensors decoded, and the contributions decoded; one with an invalid
    payload or weight is left out (``verdicts`` told)."""
    decoded, used = [], []
    for contribution in contributions:
        try:
            if not (math.isfinite(contribution.weight) and contribution.weight > 0):
                raise PayloadError(f"weight {contribution.weight} is not a positive number")
            if len(contribution.payloads) != len(numels):
                raise PayloadError(f"{len(contribution.payloads)} payloads, expected {len(numels)}")
            decoded.append([codec.decompress(p, n) for p, n in zip(contribution.payloads, numels)])
            used.append(contribution)
        except PayloadError as error:
            _left_out(verdicts, round_index, contribution, str(error))
    return decoded, used


def _screened(
    decoded: list[list[torch.Tensor]],
    used: list[Contribution],
    rules: ScreeningRules,
    verdicts: Verdicts,
    round_index: int,
    history: SketchHistory | None,
) -> tuple[list[list[torch.Tensor]], list[Contribution]]:
    """The decoded contributions kept by the screening of norms, weights and sketches (scaled and
    weighted as it says); those left out and those clipped told to ``verdicts``. A sketch is taken
    as it travels over hivemind (float32), so the verdicts are those hivemind's peers reach."""
    sketches = None
    if rules.judges_sketches:  # a codec that gathers: of its sparse values, decoded
        sketches = {i: sketch.decode(sketch.encode(sketch.sketch_of(values))) for i, values in enumerate(decoded)}
    screening = screen(
        {i: norm_of(values) for i, values in enumerate(decoded)},
        rules,
        {i: c.weight for i, c in enumerate(used)},
        sketches=sketches,
        round_index=round_index,
        history=history,
    )
    for i, reason in {**screening.dropped, **screening.repeated}.items():  # one process: one history
        _left_out(verdicts, round_index, used[i], reason)
    verdicts.clipped.update(used[i].worker for i, scale in screening.scales.items() if scale != 1.0)
    kept = [i for i in screening.scales if i not in screening.repeated]
    scaled = [[v * screening.scales[i] for v in decoded[i]] if screening.scales[i] != 1.0 else decoded[i] for i in kept]
    return scaled, [_counted(used[i], screening.weight(used[i].weight)) for i in kept]


def _means(
    codec: Codec,
    decoded: list[list[torch.Tensor]],
    used: list[Contribution],
    numels: Sequence[int],
    round_index: int,
) -> list[torch.Tensor] | None:
    """The weighted means of ``used``'s ``decoded`` tensors, as ``codec`` restores them from the
    compressed mean (a codec that gathers: its gathered mean, checked to be finite); None when a
    mean is unusable."""
    total = sum(c.weight for c in used)
    means = []
    for k in range(len(numels)):
        try:  # as a reducer replies with it; a codec that gathers is not compressed again
            if codec.gathers:  # every peer takes the gathered mean itself, as hivemind's do
                mean = codec.gathered_mean(((values[k], c.weight) for values, c in zip(decoded, used)), numels[k])
                if not all_finite(mean):
                    raise PayloadError("the mean is not finite")
                means.append(mean)
                continue
            mean = sum(values[k] * (c.weight / total) for values, c in zip(decoded, used))
            means.append(codec.reply_codec.roundtrip(mean))
        except PayloadError as error:  # finite inputs can still overflow
            logger.warning("round %d: the average is unusable: %s", round_index + 1, error)
            return None
    return means


def _left_out(verdicts: Verdicts, round_index: int, contribution: Contribution, reason: str) -> None:
    logger.warning("round %d: dropped the contribution of %s: %s", round_index + 1, contribution.worker, reason)
    verdicts.left_out[contribution.worker] = reason


def _counted(contribution: Contribution, weight: float) -> Contribution:
    """``contribution`` with the weight it counts for (a claim above the round's bound is cut)."""
    if weight == contribution.weight:
        return contribution
    logger.warning("%s claimed weight %.4g: it counts for %.4g", contribution.worker, contribution.weight, weight)
    return Contribution(contribution.worker, contribution.payloads, weight)
