"""Evaluation shared by the workers that hold the same params.

After a blocking round the workers that averaged together hold bit-identical global params, and
each declares their digest (``Membership.declared_params``). Instead of each evaluating every
held-out batch, the ``M`` workers that declared our digest for the round split them: the worker
at place ``p`` among them (in worker-index order) evaluates batches ``p::M``, publishes its losses
on the transport's board (``comm.base.LossBoard``) under a key of the round, the params' digest and
the held-out set, and reads the others' there. The round's loss is the mean over every batch
summed in batch order (``evaluation.mean_loss``): bit for bit what one worker evaluating them all
gets. Batches still missing a bound after its own share (a worker slower, gone, or that saw other
holders) it evaluates itself: at worst it evaluates everything, as alone; it never waits without
a bound and never takes a loss of other params (workers apart, after a partial or failed round or
a split run, hold other digests: other keys).

    shared = round_loss(losses_of, 8, board=board, declared=membership.declared_params, worker=0,
                        round_done=3, digest=params_digest, expected=2)       # expected: the round's peers
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from diloco.comm.base import Declared, LossBoard
from diloco.core.evaluation import mean_loss

logger = logging.getLogger(__name__)

BatchLosses = Callable[[list[int]], Sequence[float]]  # the losses of the held-out batches of these indices, in order
POLL_S = 0.05  # how often a worker waiting for others reads again


@dataclass(frozen=True)
class SharedLoss:
    """A round's loss, and how this worker got it."""

    val_loss: float
    evaluated: int  # held-out batches this worker evaluated itself
    holders: int  # workers it split them with, itself included


def round_loss(
    losses_of: BatchLosses,
    count: int,
    *,
    board: LossBoard,
    declared: Callable[[], dict[int, Declared]],
    worker: int,
    round_done: int,
    digest: str,
    expected: int,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> SharedLoss:
    """The loss after round ``round_done`` over held-out batches ``0..count-1``, split among the
    workers that declared ``digest`` for it (up to ``expected`` of them: the round's peers)."""
    timing = {"wait_s": board.wait_s, "clock": clock, "pause": pause}
    holders = wait_for_holders(
        declared, worker=worker, round_done=round_done, digest=digest, expected=expected, **timing
    )
    key = f"{round_done}.{digest[:16]}.{count}"
    return evaluate_shared(losses_of, count, board=board, key=key, worker=worker, holders=holders, **timing)


def holders_seen(declared: dict[int, Declared], *, worker: int, round_done: int, digest: str) -> list[int]:
    """``worker`` and the workers that declared ``digest`` for round ``round_done``, in index order."""
    same = {i for i, d in declared.items() if d.rounds_done == round_done and d.digest == digest[:16]}
    return sorted(same | {worker})


def wait_for_holders(
    declared: Callable[[], dict[int, Declared]],
    *,
    worker: int,
    round_done: int,
    digest: str,
    expected: int,
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> list[int]:
    """The workers holding our params after round ``round_done`` (``holders_seen``), once ``expected``
    of them declared them, or those that had after ``wait_s``. A read that fails counts as none."""
    deadline = clock() + wait_s
    while True:
        try:
            seen = holders_seen(declared(), worker=worker, round_done=round_done, digest=digest)
        except Exception:
            logger.debug("reading the declared params failed", exc_info=True)
            seen = [worker]
        if len(seen) >= expected or clock() >= deadline:
            return seen
        pause(POLL_S)


def evaluate_shared(
    losses_of: BatchLosses,
    count: int,
    *,
    board: LossBoard,
    key: str,
    worker: int,
    holders: Sequence[int],
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
    pause: Callable[[float], None] = time.sleep,
) -> SharedLoss:
    """The mean loss over held-out batches ``0..count-1``, this worker evaluating its share among
    ``holders`` (which include it) and reading the others' from ``board`` under ``key``; those not
    there ``wait_s`` seconds after its share took as long again, it evaluates itself."""
    share = list(range(holders.index(worker), count, len(holders)))
    started = clock()
    losses = dict(zip(share, losses_of(share)))
    own_s = clock() - started
    _publish(board, key, worker, losses)
    deadline = clock() + own_s + wait_s  # the others' shares take about as long as ours
    while len(losses) < count:
        for index, loss in _read(board, key, count).items():
            losses.setdefault(index, loss)
        if len(losses) == count or clock() >= deadline:
            break
        pause(POLL_S)
    missing = [i for i in range(count) if i not in losses]
    if missing:
        logger.info("evaluating %d held-out batches the other workers did not publish in time", len(missing))
        losses.update(zip(missing, losses_of(missing)))
        _publish(board, key, worker, losses)  # for a worker still waiting for them
    return SharedLoss(mean_loss([losses[i] for i in range(count)]), len(share) + len(missing), len(holders))


def _publish(board: LossBoard, key: str, worker: int, losses: dict[int, float]) -> None:
    try:
        board.publish(key, worker, dict(losses))
    except Exception:  # the others evaluate what they do not find
        logger.debug("publishing held-out losses failed", exc_info=True)


def _read(board: LossBoard, key: str, count: int) -> dict[int, float]:
    """What ``board`` holds under ``key`` of batches ``0..count-1``, finite floats only; {} if it did not answer."""
    try:
        found = board.read(key)
    except Exception:
        logger.debug("reading held-out losses failed", exc_info=True)
        return {}
    return {
        i: loss
        for i, loss in found.items()
        if type(i) is int and 0 <= i < count and type(loss) is float and math.isfinite(loss)
    }
