"""The three sync modes' time accounting and round ends (logic only: the transport, the outer
step and the log are stand-ins; tests/unit/comm/test_simulator.py and tests/integration/ run each
mode through the real loop)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from diloco.comm.base import Outcome, SyncResult
from diloco.core.overlap import Applied
from diloco.worker.records import Totals
from diloco.worker.sync_modes import (
    Accounting,
    BlockingRounds,
    DataParallelRounds,
    OverlappedRounds,
    merged,
)


class _Log:
    def __init__(self):
        self.discounted = 0.0

    def discount(self, seconds: float) -> None:
        self.discounted += seconds


class _Watchdog:
    def __init__(self):
        self.phases: list[str] = []

    def phase(self, name: str):
        self.phases.append(name)
        return _Nothing()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _accounting() -> Accounting:
    return Accounting(Totals(), _Log())


def test_a_data_parallel_steps_averages_count_as_communication_not_compute():
    done = [
        (SyncResult(Outcome.AVERAGED, 2, 16.0, bytes_sent=100), 0.25),
        (SyncResult(Outcome.AVERAGED, 2, 16.0, bytes_sent=50), 0.5),
    ]
    averaging = SimpleNamespace(params=[torch.zeros(1)], take_rounds=lambda: list(done))
    mode = DataParallelRounds(averaging, _accounting())
    accounting = mode.accounting
    mode.after_inner_step(1, 2.0)
    assert accounting.totals.compute_s == 2.0 - 0.75 and accounting.totals.comm_wait_s == 0.75
    end = mode.end_round(1, 0, weight=16)
    assert end.comm_s == 0.75 and end.result.bytes_sent == 150 and end.result.ok and not end.recovered
    assert mode.average_gradients is averaging and mode.model_is_synced


def test_a_simulated_average_costs_its_modelled_time_and_leaves_the_wait_out_of_the_wall_clock():
    averaging = SimpleNamespace(
        params=[], take_rounds=lambda: [(SyncResult(Outcome.AVERAGED, 2, 1.0, simulated_s=0.1), 0.4)]
    )
    mode = DataParallelRounds(averaging, _accounting())
    mode.after_inner_step(1, 1.0)
    assert abs(mode.accounting.log.discounted - 0.3) < 1e-9 and mode.accounting.totals.comm_wait_s == 0.1


def test_an_overlapped_round_sums_what_was_applied_since_the_last_record_and_time_spent_starting_syncs():
    results = iter([[], [Applied(SyncResult(Outcome.AVERAGED, 2, 8.0, bytes_sent=10), 0.0, recovered=True)], []])
    overlapped = SimpleNamespace(
        outer=SimpleNamespace(global_params=[torch.zeros(1)]),
        averaging=SimpleNamespace(simulated=False),
        after_inner_step=lambda step, **_: next(results),
    )
    watchdog = _Watchdog()
    mode = OverlappedRounds(overlapped, _accounting(), watchdog, samples_per_step=8, total_steps=3)
    for step in (1, 2, 3):
        mode.after_inner_step(step, 1.0)
    end = mode.end_round(3, 0, weight=24)
    assert end.recovered and end.result.bytes_sent == 10 and end.result.ok
    assert end.comm_s == mode.accounting.totals.comm_wait_s >= 0.0
    assert watchdog.phases == ["averaging"] * 3 and not mode.model_is_synced
    assert mode.end_round(3, 1, weight=0).result == merged([])  # nothing since: an empty round


class _Outer:
    def __init__(self, outcome: Outcome):
        self.global_params, self.outcome = [torch.zeros(1)], outcome

    def sync(self, averaging, **_):
        return SyncResult(self.outcome, 2, 8.0)


class _Recovery:
    """Takes the state after ``taken_round`` (None: none) after every round it is asked about."""

    def __init__(self, taken_round):
        self.taken_round, self.asked = taken_round, []

    def after_round(self, outcome, *, expected_peers, timeout_s):
        self.asked.append(outcome)
        return self.taken_round


class _Joining:
    def catch_up(self, step, round_index):
        return step + 20, round_index + 2


def _blocking(taken_round, *, steps_per_round=10, outcome=Outcome.AVERAGED) -> BlockingRounds:
    return BlockingRounds(
        _Outer(outcome),
        averaging=None,
        recovery=_Recovery(taken_round),
        accounting=_accounting(),
        watchdog=_Watchdog(),
        joining=_Joining(),
        worker_index=0,
        deadline_s=10.0,
        expected_peers=2,
        steps_per_round=steps_per_round,
        total_steps=100,
    )


def test_a_blocking_worker_that_took_the_state_of_peers_rounds_ahead_skips_to_their_round_and_step():
    end = _blocking(taken_round=4).end_round(20, 1, weight=8)
    assert end.recovered and (end.step, end.round_index) == (50, 4)
    end = _blocking(taken_round=4, steps_per_round=0).end_round(20, 1, weight=8)  # timed rounds: the step stays
    assert (end.step, end.round_index) == (20, 4)
    end = _blocking(taken_round=None).end_round(20, 1, weight=8)
    assert not end.recovered and (end.step, end.round_index) == (20, 1)


def test_a_blocking_round_is_recovered_from_after_its_outer_step_unless_it_was_postponed():
    mode = _blocking(taken_round=None, outcome=Outcome.PARTIAL)
    mode.end_round(20, 1, weight=8)
    assert [(o.round_index, o.outcome) for o in mode.recovery.asked] == [(1, Outcome.PARTIAL)]
    postponed = _blocking(taken_round=4, outcome=Outcome.POSTPONED)
    end = postponed.end_round(20, 1, weight=8)  # no outer step was taken: nothing to recover from
    assert postponed.recovery.asked == [] and not end.recovered and (end.step, end.round_index) == (20, 1)


def test_only_a_blocking_worker_catches_up_with_the_run_before_its_first_step():
    mode = _blocking(taken_round=None)
    assert mode.begin(0, 0) == (20, 2) and mode.watchdog.phases == ["downloading state"]
    averaging = SimpleNamespace(params=[], take_rounds=list)
    assert DataParallelRounds(averaging, _accounting()).begin(5, 1) == (5, 1)
