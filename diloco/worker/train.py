"""One DiLoCo worker's loop, top to bottom (its set-up from the config: build.py).

    diloco train configs/tiny.yaml                                   # first worker of a new run
    diloco train configs/tiny.yaml worker.index=1 worker.count=2 \\
        comm.hivemind.initial_peers="['/ip4/10.0.0.1/tcp/31337/p2p/12D3Koo...']"  # join it

Every ``outer.sync_every`` inner steps the worker averages its pseudo-gradient with the others
and takes an outer step (``OuterStep.sync`` in core/outer.py); overlapped and data-parallel
rounds plug into the same loop (sync_modes.py). After each round it evaluates on the
held-out batches every worker shares, logs a round record (with the hash of the global params,
which every worker must agree on) and checkpoints. Rerunning the same command resumes from the
newest checkpoint.
"""

from __future__ import annotations

import logging
import time

import torch

from diloco.config import Config
from diloco.core.digest import tensors_digest
from diloco.core.evaluation import evaluate
from diloco.core.inner import inner_step, lr_at
from diloco.worker.build import Worker, build_worker
from diloco.worker.faults import check_stop, slow_down

logger = logging.getLogger(__name__)


def train(cfg: Config, *, on_ready=None, join: bool = False) -> dict:
    """Run one worker to the end (or to ``faults.stop_after_round``); return its end record.

    ``on_ready(addresses)`` is called once the worker is reachable by peers. A worker whose peers
    are rounds ahead (it joins a live run, or restarts from an old checkpoint) first takes their
    state (``joining.py``); with ``join`` a live run is required (``JoinError`` when none is found).
    """
    worker = build_worker(cfg, join=join)  # data, model, optimizers, resumed state, transport: build.py
    model, placement, backend, held_out = worker.model, worker.placement, worker.backend, worker.held_out
    sync, clock, log, watchdog = worker.sync, worker.clock, worker.log, worker.watchdog
    samples_per_step = cfg.inner.batch_size * placement.ranks
    try:
        if on_ready is not None:
            on_ready(backend.membership.addresses)
        step, round_index = worker.begin()  # blocking: catch up with a run rounds ahead; tell how it resumed
        samples_this_round, val_loss = 0, None
        clock.start_round()
        while clock.running(step, round_index):
            # ---- inner step -------------------------------------------------------------
            watchdog.enter("training")
            started = time.perf_counter()
            loss, lr = _inner_step(worker, cfg, step, round_index)
            step += 1
            samples_this_round += samples_per_step
            step_s = time.perf_counter() - started
            backend.membership.report_progress(round_index, step, log.live)
            sync.after_inner_step(step, step_s)  # overlapped: syncs start and land
            log.step(step, round_index, loss, lr, due=step % cfg.logging.log_every == 0)
            if not clock.round_ends(step):
                continue

            # ---- outer step: every H inner steps (or outer.round_s seconds), and at the end ----
            end = sync.end_round(step, round_index, weight=samples_this_round)
            step, round_index, samples_this_round = end.step, end.round_index + 1, 0
            backend.membership.report_progress(round_index, step, log.live)
            clock.start_round()
            with watchdog.phase("hashing"):
                param_hash = tensors_digest(sync.synced_params)
            if sync.declares_params and placement.ranks == 1:  # a site's ranks hold shards of their own
                log.declare_params(round_index, param_hash, peers=end.result.peers)  # a peer may be checking a state
                backend.membership.report_progress(round_index, step, log.live)
            params_key = (param_hash, worker.held_out_hash) if sync.model_is_synced else None
            with watchdog.phase("evaluating"):
                val_loss = placement.evaluate(model, held_out, params_key)
            log.round(
                round_index,
                step,
                end.result,
                comm_s=end.comm_s,
                recovered=end.recovered,
                val_loss=val_loss,
                param_hash=param_hash,
                phases_s=watchdog.take_spent(),  # the previous round's checkpoint is in it
            )
            every = cfg.checkpoint.every_rounds
            if every and (round_index % every == 0 or not clock.running(step, round_index)):
                worker.save_checkpoint(step, round_index)
            check_stop(cfg.faults, cfg.worker.index, round_index)

        watchdog.enter("finishing")
        backend.finish()
        with watchdog.phase("checkpointing", then="finishing"):
            worker.checkpoints.close()  # the last checkpoint, written while the others finished, is on disk
        # the last round ran at the last step, on these very params: its evaluation is the final one
        # (a run resumed after its end has no round left, so it evaluates here)
        final_loss = val_loss if val_loss is not None else evaluate(model, held_out)
        return log.end(
            step,
            round_index,
            worker.totals,
            val_loss=final_loss,
            param_hash=tensors_digest(sync.synced_params),
            param_count=sum(p.numel() for p in sync.synced_params),
        )
    finally:
        worker.close()


def _inner_step(worker: Worker, cfg: Config, step: int, round_index: int) -> tuple[torch.Tensor, float]:
    """One inner step on the worker's next batch (on a site, its rank's slice): (loss as a tensor, lr)."""
    lr = lr_at(cfg.inner, worker.clock.schedule_step(step, round_index))
    batch_tensors = worker.placement.my_slice(worker.sampler.next_batch())
    loss = inner_step(
        worker.model,
        worker.inner_optimizer,
        [t.to(worker.device, non_blocking=True) for t in batch_tensors],
        lr=lr,
        grad_clip=cfg.inner.grad_clip,
        average_gradients=worker.average_gradients,
        precision=cfg.worker.precision,
    )
    slow_down(cfg.faults, cfg.worker.index)
    return loss, lr
