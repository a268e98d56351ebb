"""A worker's progress through its run, and what it does at each round's end and at the run's end.

At a round's end the worker averages its pseudo-gradient with the others and takes the outer step
(``Worker.sync``: sync_modes.py), hashes the synced params and declares them, evaluates (the
held-out loss: held_out.py), writes the round record and checkpoints when one is due. At the run's
end a round left part-done is averaged with the others, then the worker waits for late peers,
writes its last checkpoint and its end record. ``DiLoCo`` (wrapper.py) counts the steps into it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from diloco.core.digest import tensors_digest
from diloco.worker.build import Worker
from diloco.worker.faults import check_stop
from diloco.worker.held_out import HeldOutLoss

if TYPE_CHECKING:
    from diloco.worker.run import Run

logger = logging.getLogger(__name__)


class RoundEnds:
    """The inner steps and rounds of ``run``'s worker, and its round ends; ``held_out``: the
    worker's held-out loss, evaluated after each round where one is given."""

    def __init__(self, run: Run, held_out: HeldOutLoss, *, samples_per_step: int):
        self.run, self.held_out, self.samples_per_step = run, held_out, samples_per_step
        self.inner_steps = 0  # inner steps this worker has taken over the run (a resumed one: from its checkpoint)
        self.round = 0  # rounds ended
        self.params_digest: str | None = None  # the synced params' digest after the latest round
        self.val_loss: float | None = None  # the held-out loss after the latest round
        self.samples_this_round = 0
        self.checkpointed = 0  # the round of the latest checkpoint this worker wrote, or started from

    def begin_at(self, inner_steps: int, round_index: int) -> None:
        """The worker starts at ``inner_steps`` and ``round_index`` (resumed, or caught up with a
        run rounds ahead): what it starts from is on disk, or is not this worker's to write."""
        self.inner_steps, self.round = inner_steps, round_index
        self.checkpointed = round_index

    def count_step(self) -> None:
        """One more inner step, of ``samples_per_step`` samples."""
        self.inner_steps += 1
        self.samples_this_round += self.samples_per_step

    def end_round(self, worker: Worker, *, last: bool = False) -> None:
        """Average, take the outer step, evaluate, record and checkpoint (``last``: the worker's last round)."""
        cfg = self.run.config
        worker.wait_for_checkpoint("round")  # the last checkpoint's global params and momentum are written
        end = worker.sync.end_round(self.inner_steps, self.round, weight=self.samples_this_round)
        self.inner_steps, self.round, self.samples_this_round = end.step, end.round_index + 1, 0
        worker.backend.membership.report_progress(self.round, self.inner_steps, worker.log.live)
        worker.clock.start_round()
        declared = worker.sync.declares_params and worker.placement.ranks == 1  # a site's ranks hold shards
        with worker.watchdog.phase("hashing"):
            self.params_digest = digest = tensors_digest(worker.sync.synced_params)
            if declared:  # what the others declare: of the params and the outer optimizer's state
                digest = worker.sync.outer.declared_digest(self.params_digest)
        if declared:  # a peer may be checking a state of this round
            worker.backend.membership.declare_params(self.round, digest, peers=end.result.peers)
        evaluated = None  # held-out batches this worker evaluated (where it counts them)
        if self.held_out.given:
            with worker.watchdog.phase("evaluating"):
                self.val_loss, evaluated = self.held_out.after_round(
                    worker.backend,
                    end.result,
                    declared=declared,
                    worker=self.run.worker_index,
                    round_done=self.round,
                    digest=digest,  # as declared: the workers holding the same state split the batches
                )
        worker.log.round(
            self.round,
            self.inner_steps,
            end.result,
            comm_s=end.comm_s,
            recovered=end.recovered,
            val_loss=self.val_loss,
            param_hash=self.params_digest,
            phases_s=worker.watchdog.take_spent(),  # the previous round's checkpoint is in it
            eval_batches=evaluated,
        )
        self._checkpoint(worker, last=last)
        check_stop(cfg.faults, cfg.worker.index, self.round)

    def _checkpoint(self, worker: Worker, *, last: bool) -> None:
        """A checkpoint at the round just ended, when one is due (every ``checkpoint.every_rounds``,
        worth its cost, or the worker's last round)."""
        every = self.run.config.checkpoint.every_rounds
        # (one that waited for the last one's cost is taken at the next round that finds it worth it)
        due = every and (self.round % every == 0 or self.round - self.checkpointed >= every)
        due = due and worker.checkpoints.worth_taking(self.run.config.checkpoint.max_share)
        if every and (last or due or not worker.clock.running(self.inner_steps, self.round)):
            worker.save_checkpoint(self.inner_steps, self.round)
            self.checkpointed = self.round

    def finish(self, worker: Worker) -> dict:
        """The loop is over and its part-done round, if the model holds the synced params, ended
        (``end_round``): the worker waits for late peers (``backend.finish``), its last checkpoint
        is written and its end record returned."""
        if self.samples_this_round:  # the loop stopped before inner.steps, its averages still in flight
            logger.warning(
                "worker %d left at step %d, before inner.steps=%d: its overlapped averages in flight are dropped",
                self.run.worker_index,
                self.inner_steps,
                self.run.config.inner.steps,
            )
        if self.run.config.checkpoint.every_rounds and self.checkpointed < self.round:  # stopped at a round's end
            worker.save_checkpoint(self.inner_steps, self.round)
        worker.watchdog.enter("finishing")
        worker.backend.finish()
        with worker.watchdog.phase("checkpointing", then="finishing"):
            worker.checkpoints.close()  # the last checkpoint, written while the others finished, is on disk
        # the last round ran at the last step, on these very params: its evaluation is the final one
        # (a run resumed after its end has no round left, so it evaluates here)
        if self.val_loss is None and self.held_out.given:
            self.val_loss, _ = self.held_out.whole()
        synced = worker.sync.synced_params
        return worker.log.end(
            self.inner_steps,
            self.round,
            worker.totals,
            val_loss=self.val_loss,
            param_hash=tensors_digest(synced),
            param_count=sum(p.numel() for p in synced),
        )
