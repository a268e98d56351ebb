"""How a worker's rounds sync: three modes behind one interface, so that the loop has no branches.

    BlockingRounds      outer.overlap=none: at a round's end, average and take the outer step
                        (``OuterStep.sync`` in core/outer.py) while training waits; a worker that
                        took the state of peers rounds ahead (core/recovery.py) skips to their round
    OverlappedRounds    outer.overlap=delayed | streaming: averages run in the background and are
                        applied inner steps later (``OverlappedOuter`` in core/overlap.py)
    DataParallelRounds  outer.sync_every=0, the baseline: gradients are averaged inside every inner
                        step; a round is a record every logging.eval_every steps

The loop calls ``after_inner_step`` after each inner step and ``end_round`` when the round clock
says the round is over. Each mode also keeps the time accounting of its averages: a round's
``comm_s`` and what the totals count as compute and communication (records.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from diloco.comm.base import Averaging, Outcome, SyncResult
from diloco.comm.round_result import agreed_outcome
from diloco.core.outer import GradientAveraging, OuterStep
from diloco.core.overlap import OverlappedOuter
from diloco.core.recovery import Recovery, RoundOutcome
from diloco.worker.joining import Joining
from diloco.worker.records import Totals, WorkerLog
from diloco.worker.watchdog import Watchdog

logger = logging.getLogger(__name__)


@dataclass
class RoundEnd:
    """What a round's sync achieved, and where the worker stands after it."""

    result: SyncResult
    comm_s: float  # the round's communication time, as its record reports it
    recovered: bool  # the worker took a peer's state
    step: int  # a blocking worker that took the state of peers rounds ahead skips to their step
    round_index: int  # the round that ended (0-based), likewise


@dataclass
class RoundCost:
    """One average: what it achieved and what it cost."""

    result: SyncResult
    comm_s: float  # its communication time (modelled, for a simulated transport)
    recovered: bool = False  # the worker took a peer's state after it


class Accounting:
    """Adds each average's cost to the worker's totals. A simulated transport's modelled time
    replaces the time this thread actually waited (for its turn), in the totals and in the
    worker's wall clock."""

    def __init__(self, totals: Totals, log: WorkerLog):
        self.totals, self.log = totals, log

    def average(self, result: SyncResult, measured_s: float) -> RoundCost:
        comm_s = measured_s if result.simulated_s is None else result.simulated_s
        self.log.discount(measured_s - comm_s)
        self.totals.add_round(result, comm_s)
        return RoundCost(result, comm_s)


class SyncMode:
    """The interface of the three modes (each documents what it does at each call)."""

    # between backward and the inner optimizer's update (data-parallel), else None
    average_gradients = None
    # after a round the model holds exactly the synced params: its evaluation may be cached by their hash
    model_is_synced = True
    # the next round's averaging starts from the params hashed after this one, on the worker's own
    # thread: their digest tells a group whether its workers share one model (a split run met again)
    declares_params = False
    # whether the global params and the outer optimizer change only at a round's end (not within steps)
    outer_changes_at_round_end = False

    def __init__(self, synced_params: list[torch.Tensor], accounting: Accounting):
        self.synced_params = synced_params  # what every worker holds alike after a round: hashed each round
        self.accounting = accounting

    def begin(self, step: int, round_index: int) -> tuple[int, int]:
        """Before the first inner step, at ``step`` after round ``round_index``: where to start."""
        return step, round_index

    def after_inner_step(self, step: int, step_s: float) -> None:
        """Inner step ``step`` (1-based) just ran in ``step_s`` seconds: counted as compute here. A
        mode takes out what was not compute before calling this (data-parallel), and works with
        the compute total after it (overlapped)."""
        self.accounting.totals.compute_s += step_s

    def end_round(self, step: int, round_index: int, *, weight: float) -> RoundEnd:
        """Round ``round_index`` (0-based) ends after inner step ``step``; ``weight``: its samples."""
        raise NotImplementedError

    def state_dict(self) -> dict | None:
        return None  # nothing of its own to checkpoint

    def load_state_dict(self, state: dict | None) -> None:
        pass


class BlockingRounds(SyncMode):
    """Training waits at each round's end while the worker averages and takes the outer step."""

    declares_params = True
    outer_changes_at_round_end = True

    def __init__(
        self,
        outer: OuterStep,
        averaging: Averaging,
        recovery: Recovery,
        accounting: Accounting,
        watchdog: Watchdog,
        *,
        joining: Joining,
        worker_index: int,
        deadline_s: float,
        expected_peers: int,
        steps_per_round: int,
        total_steps: int,
    ):
        super().__init__(outer.global_params, accounting)
        self.outer, self.averaging, self.recovery, self.watchdog = outer, averaging, recovery, watchdog
        self.joining = joining  # where a worker behind the run starts (joining.py)
        self.worker_index = worker_index
        self.deadline_s, self.expected_peers = deadline_s, expected_peers
        # fixed rounds (not outer.round_s) end at multiples of H: a worker skipping rounds keeps to them
        self.steps_per_round, self.total_steps = steps_per_round, total_steps

    def begin(self, step: int, round_index: int) -> tuple[int, int]:
        """A worker whose peers are rounds ahead (it joins a live run, or restarts from an old
        checkpoint) first takes their state."""
        with self.watchdog.phase("downloading state"):
            return self.joining.catch_up(step, round_index)

    def end_round(self, step: int, round_index: int, *, weight: float) -> RoundEnd:
        started = time.perf_counter()
        with self.watchdog.phase("averaging"):
            result = self.outer.sync(self.averaging, weight=weight, round_index=round_index, deadline_s=self.deadline_s)
            taken_round = self._recover(result, round_index, started=started)
        comm_s = self.accounting.average(result, time.perf_counter() - started).comm_s
        if taken_round is not None and taken_round > round_index:  # the others are rounds ahead: skip to them
            logger.warning("worker %d skips from round %d to %d", self.worker_index, round_index + 1, taken_round + 1)
            if self.steps_per_round:
                step = min(self.total_steps, step + (taken_round - round_index) * self.steps_per_round)
            round_index = taken_round
        return RoundEnd(result, comm_s, taken_round is not None, step, round_index)

    def _recover(self, result: SyncResult, round_index: int, *, started: float) -> int | None:
        """After the outer step, the recovery protocol (core/recovery.py): after a round that failed,
        was partial or ran in a smaller group, the state of a peer that did better, within what is
        left of the round's deadline (never less than a short download). Returns the round of the
        state taken, or None. A postponed round took no step: nothing to recover."""
        if result.outcome is Outcome.POSTPONED:
            return None
        remaining = max(self.deadline_s - (time.perf_counter() - started), min(10.0, self.deadline_s / 4))
        outcome = RoundOutcome.of(result, round_index)
        return self.recovery.after_round(outcome, expected_peers=self.expected_peers, timeout_s=remaining)


class _AveragesWithinSteps(SyncMode):
    """A mode whose averages land inside inner steps: a round's record sums those since the last."""

    def __init__(self, synced_params: list[torch.Tensor], accounting: Accounting):
        super().__init__(synced_params, accounting)
        self._window: list[RoundCost] = []  # the averages since the last record
        self._waited_s = 0.0  # communication time since then that went to no average

    def end_round(self, step: int, round_index: int, *, weight: float) -> RoundEnd:
        window, self._window = self._window, []
        comm_s, self._waited_s = sum(cost.comm_s for cost in window) + self._waited_s, 0.0
        return RoundEnd(merged(window), comm_s, any(cost.recovered for cost in window), step, round_index)


class OverlappedRounds(_AveragesWithinSteps):
    """Each inner step may start a fragment's average and apply the ones due."""

    model_is_synced = False  # the model is the global params plus this worker's own progress

    def __init__(
        self,
        overlapped: OverlappedOuter,
        accounting: Accounting,
        watchdog: Watchdog,
        *,
        samples_per_step: int,
        total_steps: int,
    ):
        super().__init__(overlapped.outer.global_params, accounting)
        self.overlapped, self.watchdog = overlapped, watchdog
        self.samples_per_step, self.total_steps = samples_per_step, total_steps  # a sync's weight; the last step

    def after_inner_step(self, step: int, step_s: float) -> None:
        """Over a real transport all the time spent in ``after_inner_step`` is the outer step's
        (waiting for an average, and the local work around it). The simulator instead takes turns
        there: that time leaves the wall clock, and each average costs only its modelled time that
        compute did not hide. The step's time goes to the first average applied in it."""
        super().after_inner_step(step, step_s)
        totals, log = self.accounting.totals, self.accounting.log
        with self.watchdog.phase("averaging"):
            started = time.perf_counter()
            applied = self.overlapped.after_inner_step(
                step, samples_per_step=self.samples_per_step, compute_s=totals.compute_s, final=step == self.total_steps
            )
            spent = time.perf_counter() - started
        comm_s = sum(a.wait_s for a in applied) if self.overlapped.averaging.simulated else spent
        log.discount(spent - comm_s)
        for k, average in enumerate(applied):
            share = comm_s if k == 0 else 0.0
            totals.add_round(average.result, share)
            self._window.append(RoundCost(average.result, share, average.recovered))
        if not applied:  # time spent starting syncs
            totals.comm_wait_s += comm_s
            self._waited_s += comm_s

    def state_dict(self) -> dict:
        return self.overlapped.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.overlapped.load_state_dict(state)


class DataParallelRounds(_AveragesWithinSteps):
    """The baseline: each inner step averages its gradients (``GradientAveraging``, called between
    backward and the update)."""

    def __init__(self, averaging: GradientAveraging, accounting: Accounting):
        super().__init__(averaging.params, accounting)
        self.average_gradients = averaging

    def after_inner_step(self, step: int, step_s: float) -> None:
        """The step's time includes its averages: that part is communication, not compute."""
        for result, measured_s in self.average_gradients.take_rounds():
            step_s -= measured_s
            self._window.append(self.accounting.average(result, measured_s))
        super().after_inner_step(step, step_s)


def merged(window: list[RoundCost]) -> SyncResult:
    """The averages applied since the last record, as one result."""
    results = [cost.result for cost in window]
    if not results:
        return SyncResult(Outcome.AVERAGED, peers=1, total_weight=0.0)
    return SyncResult(
        agreed_outcome(Outcome.AVERAGED, [r.outcome for r in results]),
        peers=min(r.peers for r in results),
        total_weight=results[-1].total_weight,
        bytes_sent=sum(r.bytes_sent for r in results),
        bytes_recv=sum(r.bytes_recv for r in results),
        error=next((r.error for r in results if r.error), ""),
        missing=results[-1].missing,  # who the latest average missed
        expected=max(r.expected for r in results),
    )
