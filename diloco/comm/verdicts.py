"""Verdicts on whole contributions, from their sketches (``sketch.py``).

Every sender declares the sketch of its whole contribution with its weight and norm; every peer
judges the same declared sketches alike, so a contribution is left out everywhere or nowhere,
whichever part of it a peer reduces (``robust.screen`` applies these after the norm rules):

- **direction**: a sketch whose cosine to the coordinate-wise median of the other sketches of the
  round is below ``comm.min_cosine`` (by more than ``MARGIN``: a sketch's cosine is the vectors'
  within about ``1 / sqrt(sketch.SIZE)``) points against the others (a sign flip, a poisoner
  within the norm bound). The median needs ``MIN_FOR_DIRECTION`` sketches to say which one is
  off; when half or more would be left out, it speaks for nobody and none is.
- **no sketch**: a sender that declared none, or one that is not a sketch, is left out.
- **repetition**: a sketch whose cosine to a sketch of an earlier round (any contributor's, or the
  mean of that round's) is at least ``REPEAT_COSINE`` is a replay: last round's work passed off as
  this round's. Honest pseudo-gradients of consecutive rounds point alike, but not that alike
  (below 0.84 on the tests' model, where rounds are short and the loss flat).

The first two depend on the round's declarations alone. The history of earlier rounds is each
peer's own (``SketchHistory``): a peer that joined later knows fewer rounds. So a replay is not
refused by every peer alike, but left out of the sums of the reducers whose peers saw the round
it repeats (as the peers a tally excludes are: ``hivemind/exclusion.py``), and counted in their
tallies; every peer still receives every part's one average.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import torch

from diloco.comm.sketch import SIZE, cosine

logger = logging.getLogger(__name__)

MIN_FOR_DIRECTION = 4  # each judged against the median of three others at least (two: their mean, too noisy)
REPEAT_COSINE = 0.97  # a sketch this close to an earlier round's is a replay
ROUNDS_KEPT = 8  # the earlier rounds a replay is looked for in
MARGIN = 2 / SIZE**0.5  # how far below min_cosine a sketch's cosine may read for a vector at it


@dataclass(frozen=True)
class SketchVerdicts:
    """What the sketches of a round say: ``left_out``, the same on every peer that gathered the same
    declarations (no usable sketch; direction), and ``repeated``, this peer's own (replays of the
    rounds it saw): contributor -> reason."""

    left_out: dict = field(default_factory=dict)
    repeated: dict = field(default_factory=dict)


class SketchHistory:
    """The sketches of the last ``ROUNDS_KEPT`` rounds of each fragment of the params a peer judged
    (by round, then contributor), and the mean of each round's."""

    def __init__(self):
        self._rounds: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}

    def earlier(self, round_index: int, fragment: int = 0):
        """(round, whose, sketch) of every kept round of ``fragment`` before ``round_index``."""
        for (past, kept_fragment), entries in sorted(self._rounds.items()):
            if past < round_index and kept_fragment == fragment:
                for who, sketch in entries:
                    yield past, who, sketch

    def record(self, round_index: int, sketches: Mapping[Hashable, torch.Tensor], *, fragment: int = 0) -> None:
        """Keep a round's sketches (a round judged again, a retry, replaces what it kept)."""
        if not sketches:
            return
        entries = [(str(who), sketch) for who, sketch in sketches.items()]
        entries.append(("the round's mean", torch.stack(list(sketches.values())).mean(dim=0)))
        self._rounds[(round_index, fragment)] = entries
        ours = sorted(key for key in self._rounds if key[1] == fragment)
        for key in ours[:-ROUNDS_KEPT]:
            del self._rounds[key]


def judge(
    declared: Mapping[Hashable, torch.Tensor | None],
    min_cosine: float,
    *,
    round_index: int,
    fragment: int = 0,
    history: SketchHistory | None = None,
) -> SketchVerdicts:
    """What the sketches of round ``round_index`` say (``declared``: contributor -> its sketch,
    None where it declared no usable one); the round's sketches then go into ``history``. Nothing
    when ``min_cosine`` is -1 (the rules are off). The direction is judged over every usable
    sketch, whatever this peer's history says of them, so that it is the same on every peer."""
    if min_cosine <= -1.0:
        return SketchVerdicts()
    left_out = {who: "it declared no usable sketch of its contribution" for who, s in declared.items() if s is None}
    usable = {who: s for who, s in declared.items() if s is not None}
    left_out.update(_against(usable, min_cosine))
    repeated = {}
    if history is not None:
        repeated = _repeated(usable, round_index, fragment, history, skip=left_out)
        history.record(round_index, usable, fragment=fragment)
    return SketchVerdicts(left_out, repeated)


def _repeated(usable: Mapping, round_index: int, fragment: int, history: SketchHistory, *, skip: Mapping) -> dict:
    """Those of ``usable`` (not in ``skip``) within ``REPEAT_COSINE`` of a sketch of an earlier
    round; none when half or more would be (honest rounds that alike say nothing of anyone)."""
    found = {}
    earlier = list(history.earlier(round_index, fragment))
    for who, sketch in usable.items():
        if who in skip:
            continue
        for past, whose, old in earlier:
            if (cos := cosine(sketch, old)) >= REPEAT_COSINE:
                found[who] = f"it repeats a contribution of round {past + 1} ({whose}'s: cosine {cos:.3f})"
                break
    return found if 2 * len(found) < len(usable) else {}


def _against(usable: Mapping, min_cosine: float) -> dict:
    """Those of ``usable`` whose cosine to the coordinate-wise median of the
    others' sketches is below ``min_cosine`` by more than a sketch can tell (``MARGIN``): the median
    of the others, so that a contribution's own values cannot pull its reference its way (with a
    median of all, a contribution far larger than the others, or a sparse one, moved the median
    toward itself enough to read as pointing the others' way)."""
    judged = usable
    if len(judged) < MIN_FOR_DIRECTION:
        return {}
    cosines = {}
    for who, own in judged.items():
        others = torch.stack([s for other, s in judged.items() if other != who])
        median = others.quantile(0.5, dim=0)  # of an even count: the mean of the middle two
        cosines[who] = cosine(own, median)
    logger.debug("cosines to the others' median: %s (median %.3f)", cosines, statistics.median(cosines.values()))
    found = {
        who: f"it does not point the others' way (cosine {cos:.3f} to their median, below {min_cosine:g})"
        for who, cos in cosines.items()
        if not cos >= min_cosine - MARGIN
    }
    return found if 2 * len(found) < len(judged) else {}
