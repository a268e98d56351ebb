"""Robust aggregation: which contributions to a round are kept, and how much each is scaled.

A contribution whose norm is far beyond the others' (more than ``comm.max_norm_ratio`` x the
median norm of the round) is dropped; with ``comm.clip_to_median`` every kept contribution above
the median is scaled down to it. The decision depends on the norms alone, so every reducer that
screens the same norms reaches the same decision (hivemind's reducers each see only a slice of a
contribution, so there the norms travel with the matchmaking; see ``hivemind/averager.py``).

The reference is ``statistics.median_low`` over the finite norms: with two contributions it is
the smaller one, so an honest worker is the reference for a blown-up one. A median of 0 (at
least half the contributions are zero) gives nothing to compare with: the ratio rule and the
clip are off for that round rather than dropping every non-zero contribution.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Screening:
    """The decision for one round: who is dropped (and why), and the factor for each kept one."""

    dropped: dict = field(default_factory=dict)  # contributor -> reason, for the log
    scales: dict = field(default_factory=dict)  # kept contributor -> factor to multiply its values by
    median: float = math.nan  # the reference norm (nan when no norm was finite)


def screen(norms: Mapping[Hashable, float], *, max_norm_ratio: float, clip_to_median: bool) -> Screening:
    """Screen a round's contributions by their norms (``contributor -> norm``).

    Non-finite norms are dropped. When ``max_norm_ratio`` > 0, a norm above ``max_norm_ratio`` x
    the median is dropped. When ``clip_to_median``, a kept norm above the median gets the factor
    ``median / norm``; every other kept one gets 1.0."""
    finite = [float(n) for n in norms.values() if math.isfinite(n)]
    median = statistics.median_low(finite) if finite else math.nan
    dropped, scales = {}, {}
    for who, norm in norms.items():
        norm = float(norm)
        if not math.isfinite(norm):
            dropped[who] = f"its norm is {norm}"
        elif max_norm_ratio > 0 and median > 0 and norm > max_norm_ratio * median:
            dropped[who] = f"its norm {norm:.4g} is more than {max_norm_ratio:g} x the median norm {median:.4g}"
        elif clip_to_median and median > 0 and norm > median:
            scales[who] = median / norm
        else:
            scales[who] = 1.0
    return Screening(dropped, scales, median)


_NORM_CHUNK = 1 << 16  # values per fp32 norm: its rounding stays near 1e-7 of the norm


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
    norm = gathered.get("norm") if isinstance(gathered, dict) else None
    return float(norm) if isinstance(norm, int | float) and not isinstance(norm, bool) else math.nan
