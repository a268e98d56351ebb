"""One DiLoCo worker, top to bottom: config, data, model, optimizers, transport, one loop.

    diloco train configs/tiny.yaml                                   # first worker of a new run
    diloco train configs/tiny.yaml worker.index=1 worker.count=2 \\
        comm.initial_peers="['/ip4/10.0.0.1/tcp/31337/p2p/12D3Koo...']"  # join it

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
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from diloco.comm import CommBackend, CommConfig, build_backend
from diloco.comm.bounds import phase_bounds, site_limit_s
from diloco.compression import ErrorFeedback, build_codec
from diloco.config import Config, ConfigError, save_config, to_dict
from diloco.core.inner import build_inner_optimizer, inner_step, lr_at
from diloco.core.outer import GradientAveraging, OuterStep
from diloco.core.overlap import OverlappedOuter, fragments_for
from diloco.core.rounds import RoundClock
from diloco.data.corpus import ShardSampler, evaluate, load_corpus, val_batches
from diloco.models.gpt import build_model
from diloco.worker.checkpoint import CheckpointWriter, capture_rng_state, load_latest_checkpoint, restore_rng_state
from diloco.worker.faults import check_stop, slow_down, with_bad_payloads, with_faults
from diloco.worker.joining import catch_up_with_run, published_run
from diloco.worker.memory import check_model_fits
from diloco.worker.metrics import param_sha256
from diloco.worker.placement import placement_for
from diloco.worker.records import Totals, WorkerLog, totals_state
from diloco.worker.sync_modes import (
    Accounting,
    BlockingRounds,
    DataParallelRounds,
    OverlappedRounds,
    SyncMode,
)
from diloco.worker.watchdog import Watchdog

logger = logging.getLogger(__name__)


def train(cfg: Config, *, on_ready=None, join: bool = False) -> dict:
    """Run one worker to the end (or to ``faults.stop_after_round``); return its end record.

    ``on_ready(addresses)`` is called once the worker is reachable by peers. A worker whose peers
    are rounds ahead (it joins a live run, or restarts from an old checkpoint) first takes their
    state (``joining.py``); with ``join`` a live run is required (``JoinError`` when none is found).
    """
    # one process, or one rank of a site (worker.site, under torchrun) holding the whole model or
    # (worker.site_sharding=fsdp) a shard of it: placement.py. A site's collectives wait for its
    # slowest rank's round (comm/bounds.py)
    site_timeout_s = site_limit_s(cfg.comm.deadline_s)
    placement = placement_for(cfg.worker, _device(cfg.worker.device), site_timeout_s=site_timeout_s)
    if join:
        placement.check_join()
    device, ranks, leader = placement.device, placement.ranks, placement.leader
    run_dir = placement.run_dir(cfg.run_dir)  # each rank of a site has its own records
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.worker.threads:
        torch.set_num_threads(cfg.worker.threads)

    # data: this worker's shard of the train split, and the held-out batches every worker shares
    corpus = load_corpus(cfg.data)
    block, batch = cfg.model.block_size, cfg.inner.batch_size
    sampler = ShardSampler(
        corpus.train,
        block_size=block,
        batch_size=batch * ranks,  # a site draws one batch for all its ranks; each takes its slice
        shard_index=cfg.worker.index,
        num_shards=cfg.worker.shards,
        seed=cfg.seed,
        chunk=cfg.data.shard_chunk,
    )
    held_out = val_batches(
        corpus.val,
        block_size=block,
        batch_size=cfg.logging.eval_batch_size,
        num_batches=cfg.logging.eval_batches,
        seed=cfg.seed,
    )
    held_out_hash = param_sha256(x for x, _ in held_out)

    # model and optimizers: refused at once if it cannot fit (memory.py); the same seed gives every
    # worker the same initial params
    check_model_fits(cfg.model, vocab_size=corpus.vocab_size, device=device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, vocab_size=corpus.vocab_size)
    synced_local = placement.place(model)  # what the outer step averages: the params, or this rank's shards
    inner_optimizer = build_inner_optimizer(cfg.inner, model)
    codec = build_codec(cfg.compression)  # how pseudo-gradients travel
    error_feedback = ErrorFeedback(codec, enabled=cfg.compression.error_feedback)
    outer = OuterStep(synced_local, cfg.outer, error_feedback=error_feedback)
    if cfg.worker.compile:  # in place, after the optimizers: same params, same state_dict keys
        model.compile()
    torch.manual_seed(cfg.seed * 1000 + cfg.worker.index)  # dropout differs per worker

    # resume: rerunning the same command continues from the newest valid checkpoint
    parts = TrainedParts(model, inner_optimizer, outer, error_feedback, sampler)
    step, round_index, totals = 0, 0, Totals()
    checkpoints = run_dir / "checkpoints"
    if (state := load_latest_checkpoint(checkpoints, cfg.worker.index)) is not None:
        placement.check_resume(checkpoints)
        parts.load_state_dict(state, checkpoints)
        step, round_index, totals = state["step"], state["round"], Totals(**state["totals"])
        logger.info("worker %d resumed at step %d, after round %d", cfg.worker.index, step, round_index)
    if cfg.worker.index == 0:  # after the resume check: a mismatched config must not replace the run's
        save_config(cfg, run_dir / "config.yaml")

    def open_transport(comm: CommConfig) -> CommBackend:
        transport = build_backend(
            comm,
            templates=outer.global_params,
            num_workers=cfg.worker.count,
            slots=cfg.worker.shards,
            worker_index=cfg.worker.index,
            device=device,
            codec=with_bad_payloads(codec, cfg.faults, cfg.worker.index),
            fragments=fragments_for(cfg.outer, outer.global_params),
        )
        return with_faults(transport, cfg.faults, cfg.worker.index)

    backend = placement.connect(cfg.comm, open_transport)  # a site's ranks: through the site
    backend.announce_run(published_run(cfg))  # what a newcomer's config must match, and the config
    log = WorkerLog(
        cfg.logging if leader else replace(cfg.logging, wandb="disabled"),
        run_dir=run_dir,
        run_name=cfg.run.name,
        worker_index=cfg.worker.index,
        total_steps=cfg.inner.steps,
        tokens_per_step=batch * block * ranks,
        config_dict=to_dict(cfg),
        wall_s_before=totals.wall_s,
    )
    # what the worker is doing, for diloco status; a warning when a phase outlasts its bound
    watchdog = Watchdog(
        phase_bounds(cfg.comm.deadline_s, cfg.comm.matchmaking_s),
        stacks_path=run_dir / f"stacks-worker-{cfg.worker.index}.txt",
        on_phase=backend.report_phase,
    )
    # a round every outer.sync_every inner steps (or outer.round_s seconds); the data-parallel
    # baseline (sync_every 0) records one every logging.eval_every steps
    clock = RoundClock(
        sync_every=cfg.outer.sync_every or cfg.logging.eval_every,
        round_s=cfg.outer.round_s,
        total_steps=cfg.inner.steps,
    )
    sync = _sync_mode(
        cfg,
        model=model,
        outer=outer,
        backend=backend,
        accounting=Accounting(totals, log),
        watchdog=watchdog,
        timed=clock.timed,
        join=join,
    )
    sync.load_state_dict(state.get("overlap") if state is not None else None)
    # between backward and the update: a site's gradient averaging, or the data-parallel baseline's
    average_gradients = placement.site_gradient_hook(model) or sync.average_gradients

    checkpoint_writer = CheckpointWriter(checkpoints, cfg.worker.index, keep=cfg.checkpoint.keep)

    def save_worker_state(step: int, round_index: int) -> None:
        worker_state = {
            **parts.state_dict(),
            "overlap": sync.state_dict(),
            "step": step,
            "round": round_index,
            "totals": totals_state(totals, log),
        }
        worker_state = placement.checkpoint_state(worker_state)  # a sharded site's rank: its own shards
        checkpoint_writer.save(round_index, worker_state)  # a snapshot, written in the background

    try:
        if on_ready is not None:
            on_ready(backend.addresses)
        behind = round_index
        step, round_index = sync.begin(step, round_index)
        if round_index != behind and not clock.running(step, round_index) and cfg.checkpoint.every_rounds:
            with watchdog.phase("checkpointing"):  # took the run's final state: it is this worker's last
                save_worker_state(step, round_index)
        samples_this_round, val_loss = 0, None
        clock.start_round()
        while clock.running(step, round_index):
            # ---- inner step -------------------------------------------------------------
            watchdog.enter("training")
            started = time.perf_counter()
            lr = lr_at(cfg.inner, clock.schedule_step(step, round_index))
            batch_tensors = placement.my_slice(sampler.next_batch())
            loss = inner_step(
                model,
                inner_optimizer,
                [t.to(device, non_blocking=True) for t in batch_tensors],
                lr=lr,
                grad_clip=cfg.inner.grad_clip,
                average_gradients=average_gradients,
                precision=cfg.worker.precision,
            )
            slow_down(cfg.faults, cfg.worker.index)
            step += 1
            samples_this_round += batch * ranks
            sync.after_inner_step(step, time.perf_counter() - started)  # overlapped: syncs start and land
            backend.report_progress(round_index, step, log.live)
            log.step(step, round_index, loss, lr, due=step % cfg.logging.log_every == 0)
            if not clock.round_ends(step):
                continue

            # ---- outer step: every H inner steps (or outer.round_s seconds), and at the end ----
            end = sync.end_round(step, round_index, weight=samples_this_round)
            step, round_index, samples_this_round = end.step, end.round_index + 1, 0
            backend.report_progress(round_index, step, log.live)
            clock.start_round()
            with watchdog.phase("hashing"):
                param_hash = param_sha256(sync.synced_params)
            params_key = (param_hash, held_out_hash) if sync.model_is_synced else None
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
                with watchdog.phase("checkpointing"):
                    save_worker_state(step, round_index)
            check_stop(cfg.faults, cfg.worker.index, round_index)

        watchdog.enter("finishing")
        backend.finish()
        with watchdog.phase("checkpointing", then="finishing"):
            checkpoint_writer.close()  # the last checkpoint, written while the others finished, is on disk
        # the last round ran at the last step, on these very params: its evaluation is the final one
        # (a run resumed after its end has no round left, so it evaluates here)
        final_loss = val_loss if val_loss is not None else evaluate(model, held_out)
        return log.end(
            step,
            round_index,
            totals,
            val_loss=final_loss,
            param_hash=param_sha256(sync.synced_params),
            param_count=sum(p.numel() for p in sync.synced_params),
        )
    finally:
        try:
            checkpoint_writer.wait()  # a write in progress ends whole (a crash mid-write loses only it)
        except Exception:
            logger.exception("the last checkpoint could not be written")
        watchdog.stop()
        log.close()
        backend.leave()
        backend.shutdown()


@dataclass
class TrainedParts:
    """What a worker trains, each with its state in a checkpoint (and the random generators'):
    listed once, for both directions."""

    model: torch.nn.Module
    inner_optimizer: torch.optim.Optimizer
    outer: OuterStep
    error_feedback: ErrorFeedback
    sampler: ShardSampler

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "outer": self.outer.state_dict(copy=False),  # the checkpoint writer copies it (once)
            "error_feedback": self.error_feedback.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": capture_rng_state(),
        }

    def load_state_dict(self, state: dict, checkpoints: Path) -> None:
        _load_model_state(self.model, state["model"], checkpoints)
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.outer.load_state_dict(state["outer"])
        self.error_feedback.load_state_dict(state.get("error_feedback", {}))
        self.sampler.load_state_dict(state["sampler"])
        restore_rng_state(state["rng"])


def _sync_mode(
    cfg: Config,
    *,
    model: torch.nn.Module,
    outer: OuterStep,
    backend: CommBackend,
    accounting: Accounting,
    watchdog: Watchdog,
    timed: bool,
    join: bool,
) -> SyncMode:
    """The worker's rounds (sync_modes.py): data-parallel (outer.sync_every=0), overlapped
    (outer.overlap=delayed|streaming) or blocking."""
    deadline_s, workers = cfg.comm.deadline_s, cfg.worker.count
    if cfg.outer.sync_every == 0:
        weight = cfg.inner.batch_size
        averaging = GradientAveraging(list(model.parameters()), backend, weight=weight, deadline_s=deadline_s)
        return DataParallelRounds(averaging, accounting)
    if cfg.outer.overlap != "none":
        overlapped = OverlappedOuter(outer, backend, cfg.outer, deadline_s=deadline_s, expected_peers=workers)
        return OverlappedRounds(
            overlapped, accounting, watchdog, samples_per_step=cfg.inner.batch_size, total_steps=cfg.inner.steps
        )

    def catch_up(step: int, round_index: int) -> tuple[int, int]:
        return catch_up_with_run(outer, backend, step, round_index, cfg=cfg, required=join, align_step=not timed)

    return BlockingRounds(
        outer,
        backend,
        accounting,
        watchdog,
        catch_up=catch_up,
        deadline_s=deadline_s,
        expected_peers=workers,
        steps_per_round=0 if timed else cfg.outer.sync_every,
        total_steps=cfg.inner.steps,
    )


def _load_model_state(model: torch.nn.Module, saved: dict, checkpoints) -> None:
    try:
        model.load_state_dict(saved)
    except RuntimeError as error:  # another architecture or size: a long message from torch
        detail = next((line.strip() for line in str(error).splitlines()[1:] if line.strip()), str(error))
        raise ConfigError(
            f"the checkpoint in {checkpoints} is of another model ({detail.rstrip('.')}): "
            f"resume with the run's own config (its config.yaml), or start afresh in another run.dir"
        ) from None


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("worker.device=cuda but no CUDA device is visible; use worker.device=cpu or auto")
    return torch.device(name)
