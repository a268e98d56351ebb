"""What one round of averaging produced: an ``Outcome`` (what happened, named once where the
round ends) and the ``SyncResult`` that carries it with the round's figures.

Every reader (the transport's retry, the outer step, recovery, the records) asks the outcome;
none puts it together again from other fields:

    outcome     the tensors then hold                                  the outer step
    AVERAGED    the mean over every contribution the group kept         applies it
    SPLIT       the same, of a group that held several models           applies it; recovery lets
                (a split run met again: ``sides``)                      the bigger side's model win
    PARTIAL     the group's common mean, some part of it over fewer     applies it; recovery looks
                contributions (``peers``: the fewest)                   for a better state
    ALONE       the worker's own (nobody else is live)                  applies it
    CUT_OFF     the same, while workers that vanished without leaving   applies it; the worker is
                may train on apart                                      unsynced until it takes a state
    FAILED      what the caller handed in (no mean)                     applies its own; recovery
    DROPPED     the same: the group averaged without ours               looks for a better state
    POSTPONED   the same: nobody could reduce the round                 takes none; the steps count
                                                                        toward the next round
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Outcome(enum.Enum):
    """What a round did with the tensors handed to it (the table in this module's docstring)."""

    AVERAGED = "averaged"
    SPLIT = "split"
    PARTIAL = "partial"
    ALONE = "alone"
    CUT_OFF = "cut_off"
    FAILED = "failed"
    DROPPED = "dropped"
    POSTPONED = "postponed"

    @property
    def whole(self) -> bool:
        """The tensors hold a mean over every contribution kept, in every part (the records' "ok")."""
        return self in _WHOLE

    @property
    def averaged(self) -> bool:
        """The tensors hold the mean every worker of the group holds: whole, or PARTIAL."""
        return self in _WHOLE or self is Outcome.PARTIAL


_WHOLE = frozenset({Outcome.AVERAGED, Outcome.SPLIT, Outcome.ALONE, Outcome.CUT_OFF})


@dataclass(frozen=True)
class SyncResult:
    """What one round of averaging achieved: its ``outcome`` and the figures that go with it."""

    outcome: Outcome
    # workers whose contribution is in the mean (1 = only this worker; 0 = the group dropped ours); PARTIAL: the fewest
    peers: int
    total_weight: float  # sum of the weights of those workers
    bytes_sent: int = 0  # payload bytes this worker put on the wire for the round
    bytes_recv: int = 0  # payload bytes this worker took off the wire for the round
    error: str = ""  # why the round failed, was partial or postponed, for the log
    group: int = 0  # workers in the round's group, dropped ones included (0 = not known)
    simulated_s: float | None = None  # a simulated transport's modelled round time; None = measure it
    # the codec the round's peers agreed on, where the transport chose it (compression.name=adaptive)
    codec: str = ""
    # a group that held more than one model (a split run met again): how many of its workers held
    # each, ours first; empty when all held one. Only the workers of our model share our params:
    # recovery ranks the round by them (core/recovery.py)
    sides: tuple[int, ...] = ()
    # workers seen in the run that are not live now and did not leave (crashed, or cut off: a
    # split run), where the transport tracks who is live
    missing: tuple[int, ...] = ()
    # the group the round waited for: the live workers the roster expected (0 = not known)
    expected: int = 0
    # workers excluded from the run's means now (comm.exclude_after, comm/scores.py), by index
    excluded: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        """A whole mean (``Outcome.whole``)."""
        return self.outcome.whole

    @property
    def averaged(self) -> bool:
        """The tensors hold the mean every worker of the group holds (``Outcome.averaged``)."""
        return self.outcome.averaged


def agreed_outcome(own: Outcome, outcomes: Sequence[Outcome]) -> Outcome:
    """The outcome of a round made of several averages that one worker takes together (a site's
    ranks, each averaging its shard): where every one was whole, CUT_OFF if any was (so that every
    rank ranks its state alike), else ``own``; PARTIAL where each holds its group's common mean but
    some did not average whole; else FAILED (or ``own`` where it is already a round without a mean:
    dropped or postponed)."""
    if all(outcome.whole for outcome in outcomes):
        return Outcome.CUT_OFF if Outcome.CUT_OFF in outcomes else own
    if all(outcome.averaged for outcome in outcomes):
        return Outcome.PARTIAL
    return Outcome.FAILED if own.averaged else own
