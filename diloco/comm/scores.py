"""Each worker's standing across rounds, and who is excluded from the run's means.

The screening (``robust.py``) decides round by round: a contribution far above the median norm,
pointing against the others, or unreadable is left out of that round. ``Scores`` keeps the tally
across rounds: how often each worker's contribution was kept, clipped or left out. A worker whose
contribution was left out of ``comm.exclude_after`` rounds in a row is excluded: from then on, until
it is re-admitted, its contributions are left out before any screening, with one log line naming it and the reason, and
the round records list it (``excluded``). An honest worker is left out of a round now and then at
most (a slow one only weighs less; nothing about speed counts against it): a streak resets with
every round in which its contribution is kept.

An exclusion is not for ever: after ``comm.readmit_after`` rounds that the excluded worker sent in
(twice as many for its second exclusion, four times for its third, ...), it is re-admitted on
probation, with one log line: its contributions are screened again, and the first one left out
excludes it again. A worker excluded by mistake (a flaky GPU's NaNs, three rounds in a row) comes
back; an attacker gets a round in which it is screened as any worker, ever more rarely.

The tally is made by whoever reduces: the simulator's group and every torch.distributed rank for
the whole vector, the same decision for every worker; over hivemind every peer from what it saw of
the round (``hivemind/exclusion.py``). The tally lasts the run's process for the simulator and
torch.distributed; over hivemind the excluding worker's run (its standings are saved beside its
checkpoints and read back on a restart). A round of a fragment (streaming
overlap) counts as a round.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)


@dataclass
class Standing:
    """One worker's tally: rounds its contribution was kept (``clipped`` of them scaled down), left
    out, left out in a row up to now; why it is excluded ("" while it is not), how many times it
    was, and the rounds of its term it served (rounds it sent in while excluded this time)."""

    kept: int = 0
    clipped: int = 0
    left_out: int = 0
    in_a_row: int = 0
    excluded: str = ""
    exclusions: int = 0
    term_served: int = 0


class Scores:
    """The standings of the workers seen, keyed as the reducer names them (see the module's docstring)."""

    def __init__(self, exclude_after: int, readmit_after: int = 0):
        self.exclude_after = exclude_after  # 0 = never exclude
        self.readmit_after = readmit_after  # rounds excluded before probation (x 2 each time); 0 = never
        self.standings: dict[Hashable, Standing] = {}

    def to_json(self) -> dict:
        """The standings as plain data (keys as strings), for a file that outlives the process."""
        return {str(who): asdict(standing) for who, standing in self.standings.items()}

    def load_json(self, data: dict) -> None:
        """The standings ``to_json`` wrote; an entry that does not read is skipped."""
        for who, fields in data.items():
            try:
                self.standings[who] = Standing(**fields)
            except TypeError:
                continue

    def excluded(self) -> dict[Hashable, str]:
        """The excluded workers and why."""
        return {who: s.excluded for who, s in self.standings.items() if s.excluded}

    def is_excluded(self, who: Hashable) -> bool:
        standing = self.standings.get(who)
        return standing is not None and bool(standing.excluded)

    def record_round(
        self,
        sent: Iterable[Hashable],
        left_out: Mapping[Hashable, str],
        clipped: Iterable[Hashable] = (),
        *,
        context: str = "",
    ) -> list[Hashable]:
        """Count a round: ``sent`` contributed (the excluded among them left out before any
        screening), ``left_out`` were left out of it (and why), ``clipped`` kept but scaled down.
        Returns who is excluded from now on, each logged once (``context`` before the line:
        ``round 3: ``); who is re-admitted is logged too, and no longer in ``excluded()``."""
        newly, clipped = [], set(clipped)
        for who in sent:
            standing = self.standings.setdefault(who, Standing())
            if standing.excluded:
                self._serve(who, standing, context)
                continue
            if who not in left_out:
                standing.kept += 1
                standing.clipped += who in clipped
                standing.in_a_row = 0
                continue
            standing.left_out += 1
            standing.in_a_row += 1
            if self.exclude_after and standing.in_a_row >= self.exclude_after:
                standing.excluded = f"left out of {standing.in_a_row} rounds in a row, the last: {left_out[who]}"
                standing.exclusions += 1
                logger.warning("%sexcluded %s from the run's means: %s", context, who, standing.excluded)
                newly.append(who)
        return newly

    def _serve(self, who: Hashable, standing: Standing, context: str) -> None:
        """A round ``who`` sent in while excluded; once it has served its term, it is re-admitted on
        probation (one more round left out excludes it again, for twice as long)."""
        standing.term_served += 1
        standing.exclusions = max(1, standing.exclusions)  # an exclusion read from an older tally
        term = self.readmit_after * 2 ** (standing.exclusions - 1)
        if not self.readmit_after or standing.term_served < term:
            return
        standing.excluded, standing.term_served = "", 0
        standing.in_a_row = max(0, self.exclude_after - 1)
        logger.warning(
            "%sre-admitted %s to the run's means after %d rounds excluded, on probation: left out once more, "
            "it is excluded for %d rounds",
            context,
            who,
            term,
            2 * term,
        )
