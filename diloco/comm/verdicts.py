"""Verdicts on whole contributions, from their sketches (``sketch.py``).

Every sender declares the sketch of its whole contribution with its weight and norm; every peer
judges the same declared sketches alike, so a contribution is left out everywhere or nowhere,
whichever part of it a peer reduces (``robust.screen`` applies these after the norm rules):

- **direction**: a sketch whose cosine to the coordinate-wise median of the round's sketches is
  below ``comm.min_cosine`` points against the others (a sign flip, a poisoner within the norm
  bound), or nowhere in particular (noise: its cosine to anything is about 0, with a spread of
  ``1 / sqrt(sketch.SIZE)``). The median needs ``MIN_FOR_DIRECTION`` sketches to say which one is
  off; when half or more would be left out, it speaks for nobody and none is.
- **repetition**: a sketch whose cosine to a sketch of an earlier round (any contributor's, or the
  mean of that round's) is at least ``REPEAT_COSINE`` is a replay: last round's work passed off as
  this round's. Honest pseudo-gradients of consecutive rounds point alike, but not that alike
  (below 0.84 on the tests' model, where rounds are short and the loss flat).
- **no sketch**: a sender that declared none, or one that is not a sketch, is left out.

The history of earlier rounds is each peer's own (``SketchHistory``): a peer that joined later
knows fewer rounds, so a replay of a round it did not see is judged only by the others.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Hashable, Mapping

import torch

from diloco.comm import sketch as sketches_

logger = logging.getLogger(__name__)

MIN_FOR_DIRECTION = 3  # contributions the coordinate-wise median needs to tell which one is off
REPEAT_COSINE = 0.97  # a sketch this close to an earlier round's is a replay
ROUNDS_KEPT = 8  # the earlier rounds a replay is looked for in
MARGIN = 2 / sketches_.SIZE**0.5  # how far below min_cosine a sketch's cosine may read for a vector at it


class SketchHistory:
    """The sketches of the last ``ROUNDS_KEPT`` rounds a peer judged (by round and fragment of the
    params, then contributor) and the mean of each round's."""

    def __init__(self):
        self._rounds: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}

    def earlier(self, round_index: int):
        """(round, whose, sketch) of every kept round before ``round_index``."""
        for (past, _), entries in sorted(self._rounds.items()):
            if past < round_index:
                for who, sketch in entries:
                    yield past, who, sketch

    def record(self, round_index: int, sketches: Mapping[Hashable, torch.Tensor], *, fragment: int = 0) -> None:
        """Keep a round's sketches (a round judged again, a retry, replaces what it kept)."""
        if not sketches:
            return
        entries = [(str(who), sketch) for who, sketch in sketches.items()]
        entries.append(("the round's mean", torch.stack(list(sketches.values())).mean(dim=0)))
        self._rounds[(round_index, fragment)] = entries
        for key in sorted(self._rounds)[: -ROUNDS_KEPT * max(1, len({f for _, f in self._rounds}))]:
            del self._rounds[key]


def judge(
    declared: Mapping[Hashable, torch.Tensor | None],
    min_cosine: float,
    *,
    round_index: int,
    fragment: int = 0,
    history: SketchHistory | None = None,
) -> dict[Hashable, str]:
    """The contributions (``declared``: contributor -> its sketch, None where it declared no
    usable one) to leave out of round ``round_index`` and why; the round's sketches then go into
    ``history``. Nothing when ``min_cosine`` is -1 (the rules are off)."""
    if min_cosine <= -1.0:
        return {}
    left_out = {who: "it declared no usable sketch of its contribution" for who, s in declared.items() if s is None}
    usable = {who: s for who, s in declared.items() if s is not None}
    if history is not None:
        left_out.update(_repeated(usable, round_index, history))
        history.record(round_index, usable, fragment=fragment)
    left_out.update(_against(usable, min_cosine, skip=left_out))
    return left_out


def _repeated(usable: Mapping, round_index: int, history: SketchHistory) -> dict:
    found = {}
    earlier = list(history.earlier(round_index))
    for who, sketch in usable.items():
        for past, whose, old in earlier:
            if (cos := sketches_.cosine(sketch, old)) >= REPEAT_COSINE:
                found[who] = f"it repeats a contribution of round {past + 1} ({whose}'s: cosine {cos:.3f})"
                break
    return found


def _against(usable: Mapping, min_cosine: float, *, skip: Mapping) -> dict:
    """Those of ``usable`` (not in ``skip``) whose cosine to the coordinate-wise median of the
    others' sketches is below ``min_cosine`` by more than a sketch can tell (``MARGIN``): the median
    of the others, so that a contribution's own values cannot pull its reference its way (with a
    median of all, a contribution far larger than the others, or a sparse one, moved the median
    toward itself enough to read as pointing the others' way)."""
    judged = {who: s for who, s in usable.items() if who not in skip}
    if len(judged) < MIN_FOR_DIRECTION:
        return {}
    cosines = {}
    for who, own in judged.items():
        others = torch.stack([s for other, s in judged.items() if other != who])
        median = others.quantile(0.5, dim=0)  # of an even count: the mean of the middle two
        cosines[who] = sketches_.cosine(own, median)
    logger.debug("cosines to the others' median: %s (median %.3f)", cosines, statistics.median(cosines.values()))
    found = {
        who: f"it does not point the others' way (cosine {cos:.3f} to their median, below {min_cosine:g})"
        for who, cos in cosines.items()
        if not cos >= min_cosine - MARGIN
    }
    return found if 2 * len(found) < len(judged) else {}
