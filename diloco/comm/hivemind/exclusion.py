"""``comm.exclude_after`` over hivemind: each peer's standing across rounds, kept in the averager's
process from what this peer saw, and the peers excluded now handed to the worker's process.

What a peer sees of a round: the screening's verdicts (norms, weights, sketches: ``verdicts.py``),
which every peer reaches alike from what was declared at matchmaking, the replays its own history
of sketches tells, and the payloads its reducer could not use. An attacker left out alike is
excluded by every peer that averaged with it each time, in the same round; a peer that joined
later, or sat in another group, excludes it later (and a replay of a round it did not see counts
only with the peers that saw it). Peers that disagree still end
on the same params: each part is reduced in one place, and a reducer that excludes a peer leaves
its parts out of the sums (``reducer.ScreeningReducer``) and sends it the others' average, as to
anyone. The screening itself is the same on every peer: exclusion comes after it. With a codec that gathers (top-k) a
reducer screens and excludes alike: every recipient takes its mean of the senders it kept. The
standings are saved after every round beside the worker's checkpoints, so a worker that restarts
keeps its tally (the peers it excluded keep their ids unless they restart too).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from diloco.comm.robust import Screening
from diloco.comm.scores import Scores

logger = logging.getLogger(__name__)


class Exclusions:
    """The standings (``comm/scores.py``) of the peers this one averaged with, keyed ``peer <id>``."""

    def __init__(self, exclude_after: int, path: Path | None = None, *, readmit_after: int = 0):
        self.scores = Scores(exclude_after, readmit_after)
        self.path = path  # where the standings outlive the process: a restarted worker reads them back
        if path is not None and path.is_file():
            try:
                self.scores.load_json(json.loads(path.read_text()))
            except (OSError, ValueError):
                logger.warning("could not read the standings in %s: starting a new tally", path)
        self._changes = mp.SimpleQueue()  # the excluded peers after each round, from the averager's process
        # in the worker's process: the excluded peers it was last told of (those read back from ``path`` first)
        self._known = self._excluded_ids()
        self._draining = threading.Lock()  # fragments' rounds end on threads of their own

    def of(self, peers: Sequence, *, own) -> set:
        """Those of ``peers`` excluded now (never ``own``, this peer: see ``record``)."""
        return {peer for peer in peers if peer != own and self.scores.is_excluded(f"peer {peer}")}

    @staticmethod
    def screened(screening: Screening, excluded: set) -> Screening:
        """``screening`` with the excluded peers for our reducer to leave out of every part it sums:
        they send and receive as any peer (the average they get is the others'), so no sender
        waits on a refusal, and every peer still ends on the same params."""
        return dataclasses.replace(screening, excluded=frozenset(excluded)) if excluded else screening

    def record(self, senders: Sequence, screening: Screening, excluded: set, runner, *, own) -> None:
        """Count a finished round for the ``senders``, ``own`` aside (we never exclude ourselves):
        those not excluded are left out when the screening dropped them, our reducer left them out
        as replays, or their payload was unusable; those excluded serve a round of their term."""
        left_out = {peer: reason for peer, reason in screening.dropped.items()}
        left_out.update({peer: reason for peer, reason in screening.repeated.items() if peer != own})
        left_out.update(runner.payload_dropped)
        sent = [f"peer {peer}" for peer in senders if peer != own]
        named = {f"peer {peer}": reason for peer, reason in left_out.items() if peer not in excluded}
        before = self._excluded_ids()
        self.scores.record_round(sent, named)
        if (now := self._excluded_ids()) != before:
            self._changes.put(now)
        self._save()

    def _excluded_ids(self) -> set[str]:
        return {who.removeprefix("peer ") for who in self.scores.excluded()}

    def _save(self) -> None:
        """The standings to ``path`` (a temp file, then a rename: never half written)."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.scores.to_json()))
            os.replace(tmp, self.path)
        except OSError:
            logger.warning("could not save the standings to %s", self.path, exc_info=True)

    def excluded_peers(self) -> set[str]:
        """In the worker's process: the ids of the peers excluded now (those read back from ``path``
        included, those re-admitted not)."""
        with self._draining:
            while not self._changes.empty():
                self._known = self._changes.get()
            return set(self._known)
