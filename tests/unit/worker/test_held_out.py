"""A loop's held-out loss given batch by batch (``DiLoCo(batch_losses=..., eval_batches=...)``): its
mean goes into each round record with the batches counted, and mistakes are one line each."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

import diloco
from diloco.comm.base import CommBackend, Declared, LossBoard, Membership, Outcome, SyncResult
from diloco.core.evaluation import mean_loss
from diloco.errors import UsageError
from diloco.worker.held_out import HeldOutLoss

HELD_OUT = [torch.randn(4, 3, generator=torch.Generator().manual_seed(100 + i)) for i in range(5)]


def _run(tmp_path) -> diloco.Run:
    sections = {
        "comm": {"backend": "simulator", "run_id": "held_out"},
        "inner": {"steps": 4, "batch_size": 4},
        "outer": {"sync_every": 2},
        "checkpoint": {"every_rounds": 0},
    }
    return diloco.init(None, f"run.dir={tmp_path}", **sections)


def test_a_loops_batch_losses_give_each_round_their_mean_and_the_batches_counted(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def batch_losses(indices: list[int]) -> list[torch.Tensor]:
        seen.append(list(indices))
        with torch.no_grad():
            return [nn.functional.mse_loss(model(HELD_OUT[i]), HELD_OUT[i].sum(1, keepdim=True)) for i in indices]

    expected = []
    with diloco.DiLoCo(_run(tmp_path), model, inner, batch_losses=batch_losses, eval_batches=5) as dl:
        while dl.running:
            x = torch.randn(4, 3)
            nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            inner.step()
            inner.zero_grad()
            if dl.inner_steps % 2 == 0:  # the round just ended: the model holds its params
                expected.append(mean_loss([loss.item() for loss in batch_losses(range(5))]))
    rounds = [json.loads(line) for line in (tmp_path / "worker-0.jsonl").read_text().splitlines()]
    rounds = [r for r in rounds if r["event"] == "round"]
    assert [r["val_loss"] for r in rounds] == expected and len(expected) == 2  # alone: every batch, in order
    assert [r["eval_batches"] for r in rounds] == [5, 5] and seen[0] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("batch_losses", "eval_batches", "says"),
    [
        (lambda indices: [1.0 for _ in indices], 0, "batch_losses needs eval_batches"),
        (None, 4, "pass batch_losses too"),
    ],
)
def test_batch_losses_and_eval_batches_go_together(batch_losses, eval_batches, says):
    with pytest.raises(UsageError, match=says):
        HeldOutLoss(None, batch_losses, eval_batches)


def test_batch_losses_that_return_another_count_are_refused_in_one_line():
    held_out = HeldOutLoss(None, lambda indices: [1.0], 3)
    with pytest.raises(UsageError, match="returned 1 losses: return one loss per index given"):
        held_out.whole()


def test_evaluate_serves_where_the_batches_are_not_split():
    held_out = HeldOutLoss(lambda: 2.5, lambda indices: [1.0 for _ in indices], 3)
    assert held_out.whole() == (2.5, None)


class _Board(LossBoard):
    """The other worker's share, already published; what this worker publishes is kept."""

    wait_s = 2.0  # a worker that waits for what never comes waits this long

    def __init__(self, others: dict[int, float]):
        self.others, self.published = others, {}

    def publish(self, key, worker, losses):
        self.published[key] = dict(losses)

    def read(self, key):
        return dict(self.others)


class _Membership(Membership):
    def __init__(self, declared: dict[int, Declared]):
        self.declared = declared

    def declared_params(self) -> dict[int, Declared]:
        return self.declared


@pytest.mark.parametrize(
    ("result", "declared", "board", "evaluated"),
    [
        (SyncResult(Outcome.AVERAGED, 2, 2.0), True, True, [0, 2, 4]),  # averaged by both, declared: split
        (SyncResult(Outcome.PARTIAL, 2, 2.0), True, True, [0, 2, 4]),  # partial: the group's params alike
        (SyncResult(Outcome.SPLIT, 3, 3.0, sides=(2, 1)), True, True, [0, 2, 4]),  # two models met: only ours counts
        (SyncResult(Outcome.FAILED, 1, 1.0), True, True, [0, 1, 2, 3, 4]),  # a round that failed: params of its own
        (
            SyncResult(Outcome.AVERAGED, 2, 2.0),
            False,
            True,
            [0, 1, 2, 3, 4],
        ),  # not declared (overlapped rounds, a site)
        (SyncResult(Outcome.AVERAGED, 2, 2.0), True, False, [0, 1, 2, 3, 4]),  # a transport without a board
    ],
)
def test_a_worker_splits_the_batches_only_with_workers_that_hold_its_params(result, declared, board, evaluated):
    digest, seen = "e" * 64, []
    losses = [0.5, 1.5, 2.5, 3.5, 4.5]

    def batch_losses(indices: list[int]) -> list[float]:
        seen.extend(indices)
        return [losses[i] for i in indices]

    others = {1: Declared(3, digest[:16], 3), 2: Declared(3, "f" * 16, 3)}  # worker 2 holds other params
    backend = CommBackend(None, membership=_Membership(others), board=_Board({1: 1.5, 3: 3.5}) if board else None)
    held_out = HeldOutLoss(None, batch_losses, 5)
    started = time.monotonic()
    val_loss, counted = held_out.after_round(backend, result, declared=declared, worker=0, round_done=3, digest=digest)
    assert val_loss == mean_loss(losses) and seen == evaluated and counted == len(evaluated)
    assert time.monotonic() - started < 1.5  # it waited for no worker that does not hold its params
