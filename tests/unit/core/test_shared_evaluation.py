"""The held-out batches split among the workers that hold the same params: their shares combine
to exactly one worker's evaluation of every batch, shares missing at the bound are evaluated
locally, and losses of other params never mix in."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from diloco.comm.base import Declared, LossBoard
from diloco.core.evaluation import batch_losses, evaluate
from diloco.core.shared_evaluation import evaluate_shared, holders_seen, round_loss, wait_for_holders

COUNT = 8


class _Regressor(nn.Module):
    """A model with the interface ``evaluate`` calls: ``model(x, targets=y) -> (output, loss)``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 1)

    def forward(self, x, targets):
        out = self.linear(x).squeeze(-1)
        return out, nn.functional.mse_loss(out, targets)


class _Board(LossBoard):
    """The board on a dict, shared by workers in threads; what each worker published, in order."""

    def __init__(self):
        self._lock = threading.Lock()
        self.records: dict[str, dict[int, dict[int, float]]] = {}
        self.published: list[tuple[str, int, dict[int, float]]] = []

    def publish(self, key, worker, losses):
        with self._lock:
            self.records.setdefault(key, {})[worker] = dict(losses)
            self.published.append((key, worker, dict(losses)))

    def read(self, key):
        with self._lock:
            return {i: loss for losses in self.records.get(key, {}).values() for i, loss in losses.items()}


class _Clock:
    """Time that passes only when a worker pauses."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.now += seconds


def _counted(model: nn.Module, batches: list) -> tuple[callable, list[int]]:
    """``losses_of(indices)`` on ``model``, and the list of every index it evaluated."""
    evaluated: list[int] = []

    def losses_of(indices: list[int]) -> list[float]:
        evaluated.extend(indices)
        return batch_losses(model, batches, indices)

    return losses_of, evaluated


@pytest.fixture
def held_out():
    torch.manual_seed(0)
    model = _Regressor()
    batches = [(torch.randn(4, 16), torch.randn(4)) for _ in range(COUNT)]
    return model, batches


def test_two_workers_each_evaluate_half_and_both_get_exactly_one_workers_loss(held_out):
    model, batches = held_out
    board, results, counted = _Board(), {}, {}

    def worker(index: int) -> None:
        losses_of, counted[index] = _counted(copy.deepcopy(model), batches)  # bit-identical params of its own
        results[index] = evaluate_shared(
            losses_of, COUNT, board=board, key="3.abc.8", worker=index, holders=[0, 1], wait_s=60.0
        )

    threads = [threading.Thread(target=worker, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    whole = evaluate(model, batches)
    assert results[0].val_loss == whole and results[1].val_loss == whole  # bit for bit, not approximately
    assert sorted(counted[0]) == [0, 2, 4, 6] and sorted(counted[1]) == [1, 3, 5, 7]
    assert results[0].evaluated == results[1].evaluated == 4 and results[0].holders == 2


def test_a_share_nobody_published_is_evaluated_locally_once_the_bound_has_passed(held_out):
    model, batches = held_out
    board, clock = _Board(), _Clock()
    losses_of, evaluated = _counted(model, batches)
    result = evaluate_shared(
        losses_of,
        COUNT,
        board=board,
        key="3.abc.8",
        worker=1,
        holders=[0, 1, 2],
        wait_s=5.0,
        clock=clock,
        pause=clock.pause,
    )
    assert result.val_loss == evaluate(model, batches) and result.evaluated == COUNT
    assert evaluated[:3] == [1, 4, 7] and sorted(evaluated[3:]) == [0, 2, 3, 5, 6]  # its share first, then the rest
    assert 5.0 <= clock.now <= 5.0 + 0.2  # waited out the bound (its own share took no time here), no longer
    assert sorted(board.published[-1][2]) == list(range(COUNT))  # published for a worker still waiting


def test_a_share_published_late_but_within_the_bound_is_read_not_evaluated(held_out):
    model, batches = held_out
    clock = _Clock()
    other = dict(zip(range(1, COUNT, 2), batch_losses(model, batches, range(1, COUNT, 2))))

    class _LateBoard(_Board):
        def read(self, key):
            if clock.now >= 2.0:  # the other worker's share lands two seconds in
                self.records.setdefault(key, {})[1] = other
            return super().read(key)

    losses_of, evaluated = _counted(model, batches)
    result = evaluate_shared(
        losses_of,
        COUNT,
        board=_LateBoard(),
        key="k",
        worker=0,
        holders=[0, 1],
        wait_s=5.0,
        clock=clock,
        pause=clock.pause,
    )
    assert result.val_loss == evaluate(model, batches) and evaluated == [0, 2, 4, 6] and result.evaluated == 4


def test_losses_of_other_params_never_mix_in(held_out):
    model, batches = held_out
    apart = copy.deepcopy(model)  # a worker apart (a split run, a failed round): other params
    with torch.no_grad():
        apart.linear.bias.add_(1.0)
    board, clock = _Board(), _Clock()
    mine, theirs = "a" * 64, "b" * 64

    def loss_of(worker: int, params: nn.Module, digest: str, declared: dict) -> tuple:
        losses_of, evaluated = _counted(params, batches)
        common = {"board": board, "round_done": 3, "expected": 2, "clock": clock, "pause": clock.pause}
        result = round_loss(losses_of, COUNT, declared=lambda: declared, worker=worker, digest=digest, **common)
        return result, evaluated

    theirs_result, _ = loss_of(1, apart, theirs, {})  # it saw nobody with its params: evaluated all, published
    # worker 0 is told (a stale record, say) that worker 1 holds its params: it splits with it, but
    # finds nothing under its own params' key, and evaluates worker 1's share itself
    result, evaluated = loss_of(0, model, mine, {1: Declared(3, mine[:16], 3)})
    assert theirs_result.val_loss == evaluate(apart, batches) != evaluate(model, batches)
    assert result.val_loss == evaluate(model, batches) and result.holders == 2
    assert evaluated[:4] == [0, 2, 4, 6] and sorted(evaluated) == list(range(COUNT))


def test_holders_are_the_workers_that_declared_our_digest_for_this_round_in_index_order():
    digest = "c" * 64
    declared = {
        4: Declared(3, digest[:16], 3),
        2: Declared(3, digest[:16], 3),
        5: Declared(2, digest[:16], 3),  # the same params a round before: not this round's
        6: Declared(3, "d" * 16, 3),  # other params
    }
    assert holders_seen(declared, worker=3, round_done=3, digest=digest) == [2, 3, 4]


def test_a_worker_waits_for_the_holders_the_round_counted_within_a_bound():
    digest, clock, reads = "c" * 64, _Clock(), []

    def declared():
        reads.append(clock.now)
        return {1: Declared(3, digest[:16], 3)} if len(reads) >= 3 else {}  # declared on the third read

    found = wait_for_holders(
        declared, worker=0, round_done=3, digest=digest, expected=2, wait_s=5.0, clock=clock, pause=clock.pause
    )
    assert found == [0, 1] and len(reads) == 3
    clock.now = 0.0
    found = wait_for_holders(
        lambda: {}, worker=0, round_done=3, digest=digest, expected=2, wait_s=5.0, clock=clock, pause=clock.pause
    )
    assert found == [0] and 5.0 <= clock.now <= 5.2  # the other never declared: alone after the bound


def test_a_board_that_fails_or_holds_garbage_costs_time_never_a_wrong_loss(held_out):
    model, batches = held_out
    clock = _Clock()

    class _Broken(_Board):
        def read(self, key):
            return {0: "x", 1: float("nan"), COUNT: 1.0, -1: 2.0, "2": 3.0}

        def publish(self, key, worker, losses):
            raise TimeoutError("the DHT did not answer")

    losses_of, _ = _counted(model, batches)
    result = evaluate_shared(
        losses_of, COUNT, board=_Broken(), key="k", worker=0, holders=[0, 1], wait_s=1.0, clock=clock, pause=clock.pause
    )
    assert result.val_loss == evaluate(model, batches) and result.evaluated == COUNT
