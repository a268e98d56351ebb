"""``comm.exclude_after`` over hivemind: each peer's standing across rounds, kept in the averager's
process from what this peer saw, and the peers excluded so far handed to the worker's process.

What a peer sees of a round: the norm screening's verdicts, which every peer reaches alike from the
norms declared at matchmaking; and the direction verdicts of the parts its own reducer averaged
(``reducer.ScreeningReducer``: a sender counts as left out when it was left out of at least half of
the parts of it we reduced). An attacker whose contribution is left out is left out by every
reducer, so every peer's tally excludes it in the same round. An excluded peer is treated as one
the round's screening dropped: its parts are refused by our reducer, and it takes no part of our
average (``averager.ExactAllReduceRunner``). A peer that reduces nothing (a client) sees only the
norm verdicts.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
from collections.abc import Sequence

from diloco.comm.hivemind.reducer import ScreeningReducer
from diloco.comm.robust import Screening
from diloco.comm.scores import Scores

logger = logging.getLogger(__name__)


class Exclusions:
    """The standings (``comm/scores.py``) of the peers this one averaged with, by peer id."""

    def __init__(self, exclude_after: int):
        self.scores = Scores(exclude_after)
        self._newly = mp.SimpleQueue()  # from the averager's process to the worker's
        self._known: set[str] = set()  # in the worker's process: the excluded peers it was told of

    def of(self, peers: Sequence) -> set:
        """Those of ``peers`` excluded so far."""
        return {peer for peer in peers if self.scores.is_excluded(str(peer))}

    @staticmethod
    def screened(screening: Screening, excluded: set) -> Screening:
        """``screening`` with the excluded peers dropped (every reducer refuses them up front)."""
        if not excluded:
            return screening
        dropped = {**screening.dropped, **dict.fromkeys(excluded, "excluded from the run's means")}
        scales = {peer: scale for peer, scale in screening.scales.items() if peer not in excluded}
        return dataclasses.replace(screening, dropped=dropped, scales=scales)

    def record(self, senders: Sequence, screening: Screening, excluded: set, reducer) -> None:
        """Count the round for the ``senders`` (by sender index) not excluded: left out when the
        screening dropped them or our reducer left them out of most of the parts of theirs it averaged."""
        left_out = {str(peer): reason for peer, reason in screening.dropped.items() if peer not in excluded}
        if isinstance(reducer, ScreeningReducer):
            for index, reasons in reducer.left_out.items():
                if len(reasons) >= reducer.kept_parts.get(index, 0):
                    left_out.setdefault(str(senders[index]), reasons[0])
        taken = [str(peer) for peer in senders if peer not in excluded]
        for peer in self.scores.record_round(taken, left_out):
            logger.warning("excluded peer %s from the run's means: %s", peer, self.scores.excluded()[peer])
            self._newly.put(peer)

    def excluded_peers(self) -> set[str]:
        """In the worker's process: every peer excluded so far."""
        while not self._newly.empty():
            self._known.add(self._newly.get())
        return set(self._known)
