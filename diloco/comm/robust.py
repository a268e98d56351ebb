"""Robust aggregation: which contributions to a round are kept, how much each is scaled, and
how much its weight may count.

By norm (``screen``): a contribution whose norm is far beyond the others' (more than
``comm.max_norm_ratio`` x the median norm of the round) is dropped, and so is one that carries
next to nothing for the samples it claims (its norm under ``1 / comm.max_norm_ratio**2`` of the
median norm, and its norm per sample under ``1 / comm.max_norm_ratio`` of the median norm per
sample: a free rider's zeros); with ``comm.clip_to_median`` every kept contribution above the
median is scaled down to it; no weight counts for more than ``comm.max_weight_ratio`` x the
median weight of the round (a claim above it is cut to it). The
decision depends on the declared norms and weights alone, so every reducer that screens the same
declarations reaches the same decision (hivemind's reducers each see only a slice of a
contribution, so there the norms travel with the matchmaking; see ``hivemind/screening.py``).

By the whole contribution's sketch (``verdicts.py``): one that points against the others' median
is dropped too. Every sender declares its sketch, so every peer judges whole contributions alike,
whichever part of them it reduces; one that repeats an earlier round's (a replay), which each peer
tells from its own history, is marked ``repeated`` for that peer's reducer to leave out.

The reference is ``statistics.median_low`` over the finite norms: with two contributions it is
the smaller one, so an honest worker is the reference for a blown-up one. A median of 0 (at
least half the contributions are zero) gives nothing to compare with: the ratio rule and the
clip are off for that round rather than dropping every non-zero contribution.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from diloco.comm import sketch, verdicts
from diloco.comm.verdicts import SketchHistory

logger = logging.getLogger(__name__)

_NORM_CHUNK = 1 << 16  # values per fp32 norm: its rounding stays near 1e-7 of the norm


@dataclass(frozen=True)
class ScreeningRules:
    """The run's screening settings (``comm.max_norm_ratio``, ``comm.clip_to_median``,
    ``comm.max_weight_ratio``, ``comm.min_cosine``, and across rounds ``comm.exclude_after`` and
    ``comm.readmit_after``: ``scores.py``); the defaults screen nothing."""

    max_norm_ratio: float = 0.0  # 0 = off
    clip_to_median: bool = False
    max_weight_ratio: float = 0.0  # 0 = off
    min_cosine: float = -1.0  # -1 = off (no cosine is below it)
    exclude_after: int = 0  # 0 = off
    readmit_after: int = 0  # 0 = never

    @classmethod
    def of(cls, comm) -> ScreeningRules:
        """The rules a run's ``comm`` config section sets."""
        return cls(
            comm.max_norm_ratio,
            comm.clip_to_median,
            comm.max_weight_ratio,
            comm.min_cosine,
            comm.exclude_after,
            comm.readmit_after,
        )

    @property
    def judges_sketches(self) -> bool:
        """Whether a round judges its contributions' sketches (``verdicts.py``): each sender then
        declares one."""
        return self.min_cosine > -1.0


NO_SCREENING = ScreeningRules()


@dataclass(frozen=True)
class Screening:
    """The decision for one round: who is dropped (and why), the factor for each kept one, and
    the most a weight counts for; and whom the reducer that holds it leaves out of what it sums
    (``excluded``: a hivemind peer's own tally, comm/hivemind/exclusion.py, and ``repeated``: the
    replays its own history tells, which other peers may not know of)."""

    dropped: dict = field(default_factory=dict)  # contributor -> reason, for the log
    scales: dict = field(default_factory=dict)  # kept contributor -> factor to multiply its values by
    median: float = math.nan  # the reference norm (nan when no norm was finite)
    max_weight: float = math.inf  # a weight above it counts as it (``comm.max_weight_ratio``)
    excluded: frozenset = frozenset()  # contributors our reducer leaves out (they still get its average)
    repeated: dict = field(default_factory=dict)  # kept, but replays by our history: our reducer leaves them out

    def weight(self, claimed: float) -> float:
        """What a contribution that claims ``claimed`` counts for."""
        return min(claimed, self.max_weight)


def screen(
    norms: Mapping[Hashable, float],
    rules: ScreeningRules,
    weights: Mapping[Hashable, float] | None = None,
    *,
    sketches: Mapping[Hashable, torch.Tensor | None] | None = None,
    round_index: int = 0,
    fragment: int = 0,
    history: SketchHistory | None = None,
) -> Screening:
    """Screen a round's contributions by their norms (``contributor -> norm``) and weights.

    Non-finite norms are dropped. When ``max_norm_ratio`` > 0, a norm above ``max_norm_ratio`` x
    the median is dropped, and so is one that carries next to nothing for the samples it claims
    (``_too_small``). When ``clip_to_median``, a kept norm above the median gets the factor
    ``median / norm``; every other kept one gets 1.0. When ``max_weight_ratio`` > 0, the most a
    weight counts for is that x the median (low) of the positive finite ``weights``. Then, when
    ``rules.min_cosine`` is above -1, the kept contributions' ``sketches`` are judged
    (``verdicts.judge``: direction and missing sketches, the same on every peer, into ``dropped``;
    replays of the rounds in ``history``, this peer's own, into ``repeated``)."""
    finite = [float(n) for n in norms.values() if math.isfinite(n)]
    median = statistics.median_low(finite) if finite else math.nan
    max_weight = _max_weight(weights or {}, rules)
    too_small = _too_small(norms, median, weights, max_weight, rules.max_norm_ratio)
    dropped, scales = {}, {}
    for who, norm in norms.items():
        norm = float(norm)
        if not math.isfinite(norm):
            dropped[who] = f"its norm is {norm}"
        elif rules.max_norm_ratio > 0 and median > 0 and norm > rules.max_norm_ratio * median:
            ratio = rules.max_norm_ratio
            dropped[who] = f"its norm {norm:.4g} is more than {ratio:g} x the median norm {median:.4g}"
        elif who in too_small:
            dropped[who] = too_small[who]
        elif rules.clip_to_median and median > 0 and norm > median:
            scales[who] = median / norm
        else:
            scales[who] = 1.0
    if sketches is not None:
        kept = {who: sketches.get(who) for who in scales}
        judged = verdicts.judge(kept, rules.min_cosine, round_index=round_index, fragment=fragment, history=history)
        for who, reason in judged.left_out.items():
            dropped[who] = reason
            del scales[who]
        return Screening(dropped, scales, median, max_weight, repeated=judged.repeated)
    return Screening(dropped, scales, median, max_weight)


def _too_small(
    norms: Mapping[Hashable, float],
    median: float,
    weights: Mapping[Hashable, float] | None,
    max_weight: float,
    ratio: float,
) -> dict:
    """The contributions that carry next to nothing for the samples they claim (a free rider's zeros,
    or noise too faint to matter): a norm under ``1 / ratio**2`` of the round's median norm and a
    norm per sample counted under ``1 / ratio`` of the median norm per sample (both ``median_low``).
    Nothing without weights, with ``ratio`` 0, or when a median is 0 (so never in a group of two,
    whose median is the smaller norm, nor when half the group sends zeros).

    The two bounds leave honest contributions in: a worker that trained on fewer samples (a slower
    one, in time-budgeted rounds) moved its params by less, but by more per sample, never less
    (updates add up less than in proportion as they pile up); a site of many ranks, whose vector
    is their mean, claims many samples but has an honest norm; a worker whose error feedback holds
    nothing yet (a newcomer, with a codec that keeps a residual) sends less than the others, but
    not 100 x less."""
    if ratio <= 0 or not weights or not median > 0:
        return {}
    per_sample = {}
    for who, norm in norms.items():
        weight = min(float(weights.get(who, math.nan)), max_weight)
        if math.isfinite(norm) and math.isfinite(weight) and weight > 0:
            per_sample[who] = float(norm) / weight
    if not per_sample or (median_per_sample := statistics.median_low(per_sample.values())) <= 0:
        return {}
    return {
        who: f"its norm {norms[who]:.4g} is less than 1/{ratio**2:g} of the median norm {median:.4g} and "
        f"1/{ratio:g} of what its samples warrant ({value:.4g} a sample, the median {median_per_sample:.4g})"
        for who, value in per_sample.items()
        if norms[who] * ratio**2 < median and value * ratio < median_per_sample
    }


def _max_weight(weights: Mapping[Hashable, float], rules: ScreeningRules) -> float:
    usable = [float(w) for w in weights.values() if math.isfinite(w) and w > 0]
    if rules.max_weight_ratio <= 0 or not usable:
        return math.inf
    return rules.max_weight_ratio * statistics.median_low(usable)


def norm_of(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of several tensors taken as one vector: fp32 norms of short slices, summed in
    float64 (a float64 norm of the whole would copy it to float64 first: 10 x slower); a slice
    whose squares overflow fp32 is taken again in float64, so finite fp32 values never overflow."""
    squares = 0.0
    for tensor in tensors:
        for chunk in tensor.detach().reshape(-1).split(_NORM_CHUNK):
            norm = float(torch.linalg.vector_norm(chunk))
            if math.isinf(norm):
                norm = float(torch.linalg.vector_norm(chunk, dtype=torch.float64))
            squares += norm * norm
    return math.sqrt(squares)


def declared_norm(gathered: object) -> float:
    """The norm a hivemind peer declared in its gathered data (``{"weight": ..., "norm": ...}``);
    nan when it declared none or something that is not a number (such a peer is dropped)."""
    return _declared_number(gathered, "norm")


def declared_weights(gathered: Mapping[Hashable, object]) -> dict:
    """The weight each hivemind peer declared in its gathered data (nan where it declared none)."""
    return {peer: _declared_number(data, "weight") for peer, data in gathered.items()}


def declared_sketches(gathered: Mapping[Hashable, object]) -> dict:
    """The sketch each hivemind peer declared in its gathered data (None where it declared none
    that is usable)."""
    found = {}
    for peer, data in gathered.items():
        found[peer] = sketch.decode(data.get("sketch") if isinstance(data, dict) else None)
    return found


def _declared_number(gathered: object, key: str) -> float:
    value = gathered.get(key) if isinstance(gathered, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
