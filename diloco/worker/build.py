"""A worker set up from its config: data, model, optimizers, the resumed state, the transport,
its records and how its rounds sync. ``train.py`` runs the loop over what ``build_worker`` returns.

Rerunning the same command resumes from the newest valid checkpoint (or, when the worker's own
newest is damaged, the newest usable state: resume.py): ``Worker.state_dict`` lists what a
checkpoint holds once, and ``build_worker`` loads it back part by part.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from diloco.comm import CommBackend, CommConfig, build_backend
from diloco.comm.bounds import phase_bounds, site_limit_s
from diloco.compression import ErrorFeedback, build_codec
from diloco.config import Config, ConfigError, save_config, to_dict
from diloco.core.digest import tensors_digest
from diloco.core.inner import build_inner_optimizer
from diloco.core.outer import GradientAveraging, OuterStep
from diloco.core.overlap import OverlappedOuter, fragments_for
from diloco.core.rounds import RoundClock
from diloco.data.corpus import ShardSampler, load_corpus, val_batches
from diloco.errors import make_folder
from diloco.models.gpt import build_model
from diloco.worker.checkpoint import CheckpointWriter, capture_rng_state, checkpoint_folder, restore_rng_state
from diloco.worker.faults import with_bad_payloads, with_faults
from diloco.worker.joining import catch_up_with_run, published_run
from diloco.worker.memory import check_model_fits
from diloco.worker.placement import Placement, placement_for
from diloco.worker.records import Totals, WorkerLog, totals_state
from diloco.worker.resume import Resume, choose_resume, model_shapes, told
from diloco.worker.sync_modes import Accounting, BlockingRounds, DataParallelRounds, OverlappedRounds, SyncMode
from diloco.worker.watchdog import Watchdog

logger = logging.getLogger(__name__)


@dataclass
class Worker:
    """Everything one worker's loop uses. ``start_step`` and ``start_round`` are where it starts
    (0 for a new run, the checkpoint's for a resumed one); ``totals`` go on from there."""

    cfg: Config
    placement: Placement  # one process, or a rank of a site (placement.py)
    device: torch.device
    sampler: ShardSampler  # this worker's shard of the train split
    held_out: list  # the held-out batches every worker shares
    held_out_hash: str
    model: torch.nn.Module
    inner_optimizer: torch.optim.Optimizer
    outer: OuterStep  # the global params and the outer optimizer (core/outer.py)
    error_feedback: ErrorFeedback
    backend: CommBackend
    log: WorkerLog
    watchdog: Watchdog  # what the worker is doing, for diloco status; a warning when a phase outlasts its bound
    clock: RoundClock  # when a round ends
    sync: SyncMode  # how its rounds sync: blocking, overlapped or data-parallel (sync_modes.py)
    # between backward and the update: a site's averaging, or the data-parallel baseline's
    average_gradients: Callable[[], None] | None
    checkpoints: CheckpointWriter
    start_step: int
    start_round: int
    totals: Totals
    resume: Resume  # where its state came from (resume.py)

    def state_dict(self, step: int, round_index: int) -> dict:
        """What a checkpoint after round ``round_index`` holds (a sharded site's rank: its own shards)."""
        state = {
            "model": self.model.state_dict(),
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "outer": self.outer.state_dict(copy=False),  # the checkpoint writer copies it (once)
            "error_feedback": self.error_feedback.state_dict(),
            "overlap": self.sync.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": capture_rng_state(),
            "step": step,
            "round": round_index,
            "totals": totals_state(self.totals, self.log),
        }
        return self.placement.checkpoint_state(state)

    def begin(self) -> tuple[int, int]:
        """Where training starts, (step, round): the resumed state's, or the live run's when its
        peers are rounds ahead (blocking rounds catch up with them: joining.py); how the worker
        resumed is recorded, in one line. A worker that took the run's final state checkpoints it."""
        step, round_index = self.sync.begin(self.start_step, self.start_round)
        caught_up = round_index != self.start_round
        resumed = told(self.resume, self.cfg.worker.index, step=step, round_index=round_index, caught_up=caught_up)
        if resumed is not None:
            self.log.resume(*resumed)
        if caught_up and not self.clock.running(step, round_index) and self.cfg.checkpoint.every_rounds:
            self.save_checkpoint(step, round_index)  # took the run's final state: it is this worker's last
        return step, round_index

    def save_checkpoint(self, step: int, round_index: int) -> None:
        with self.watchdog.phase("checkpointing"):
            self.checkpoints.save(round_index, self.state_dict(step, round_index))  # written in the background

    def close(self) -> None:
        try:
            self.checkpoints.wait()  # a write in progress ends whole (a crash mid-write loses only it)
        except Exception:
            logger.exception("the last checkpoint could not be written")
        self.watchdog.stop()
        self.log.close()
        self.backend.membership.leave()
        self.backend.shutdown()


@dataclass
class _Trained:
    """What training changes, built alike on every worker from the seed; a checkpoint holds each."""

    model: torch.nn.Module
    inner_optimizer: torch.optim.Optimizer
    error_feedback: ErrorFeedback
    outer: OuterStep

    def load_state_dict(self, state: dict, checkpoints: Path) -> None:
        """``Worker.state_dict``'s parts read back, before the transport starts (a checkpoint of
        another model is refused at once)."""
        _load_model_state(self.model, state["model"], checkpoints)
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.outer.load_state_dict(state["outer"])
        self.error_feedback.load_state_dict(state.get("error_feedback", {}))


def build_worker(cfg: Config, *, join: bool = False) -> Worker:
    """Set up one worker from ``cfg``, resumed from its newest checkpoint if it has one. With
    ``join`` a live run is required (checked before the first step, ``joining.py``)."""
    placement = _placement(cfg, join=join)
    run_dir = placement.run_dir(cfg.run_dir)  # each rank of a site has its own records
    make_folder(run_dir, "run.dir", ConfigError)
    if cfg.worker.threads:
        torch.set_num_threads(cfg.worker.threads)
    sampler, held_out, vocab_size = _data(cfg, ranks=placement.ranks)
    # refused at once if it cannot fit (memory.py)
    _claim_memory(cfg, placement.device, vocab_size=vocab_size)
    trained = _build_trained(cfg, placement, vocab_size=vocab_size)

    # resume: rerunning the same command continues from the newest valid checkpoint
    checkpoints = run_dir / "checkpoints"
    resume = _resume(cfg, placement, trained, sampler, checkpoints)
    state = resume.state
    step, round_index = (state["step"], state["round"]) if state else (0, 0)
    totals = Totals(**state["totals"]) if state else Totals()
    if cfg.worker.index == 0:  # after the resume check: a mismatched config must not replace the run's
        save_config(cfg, run_dir / "config.yaml")

    # a site's ranks connect through the site
    backend = placement.connect(cfg.comm, _transport_opener(cfg, trained, placement.device))
    trained.outer.recovery.connect(backend.states, backend.membership)  # what recovery uses of the transport
    with contextlib.ExitStack() as undo:  # should a step below fail, what started is stopped again
        undo.callback(backend.shutdown)
        undo.callback(backend.membership.leave)
        backend.membership.announce_run(published_run(cfg))  # what a newcomer's config must match, and the config
        log = _worker_log(cfg, placement, run_dir, wall_s_before=totals.wall_s)
        undo.callback(log.close)
        watchdog = Watchdog(
            phase_bounds(cfg.comm.deadline_s, cfg.comm.hivemind.matchmaking_s),
            stacks_path=run_dir / f"stacks-worker-{cfg.worker.index}.txt",
            on_phase=backend.membership.report_phase,
        )
        undo.callback(watchdog.stop)
        sync = _sync_mode(cfg, trained, backend, Accounting(totals, log), watchdog, join=join)
        sync.load_state_dict(state.get("overlap") if state is not None else None)
        worker = Worker(
            cfg=cfg,
            placement=placement,
            device=placement.device,
            sampler=sampler,
            held_out=held_out,
            held_out_hash=tensors_digest(x for x, _ in held_out),
            model=trained.model,
            inner_optimizer=trained.inner_optimizer,
            outer=trained.outer,
            error_feedback=trained.error_feedback,
            backend=backend,
            log=log,
            watchdog=watchdog,
            clock=_round_clock(cfg),
            sync=sync,
            average_gradients=placement.site_gradient_hook(trained.model) or sync.average_gradients,
            checkpoints=CheckpointWriter(checkpoints, cfg.worker.index, keep=cfg.checkpoint.keep),
            start_step=step,
            start_round=round_index,
            totals=totals,
            resume=resume,
        )
        undo.pop_all()  # all set: they are the worker's to close (Worker.close)
    return worker


def _resume(cfg: Config, placement: Placement, trained: _Trained, sampler: ShardSampler, checkpoints: Path) -> Resume:
    """The state chosen by ``choose_resume`` (resume.py), loaded: this worker's own whole, or
    what it takes of another worker's (its data position rebuilt on its own shard, its RNG its
    seed's). Only one process holding the whole model takes another worker's checkpoint."""
    shapes = model_shapes(trained.model) if placement.ranks == 1 else None
    resume = choose_resume(checkpoints, cfg.worker.index, model_shapes=shapes)
    if (state := resume.state) is None:
        return resume
    placement.check_resume(checkpoints)
    trained.load_state_dict(state, checkpoints)
    if resume.own:
        sampler.load_state_dict(state["sampler"])
        restore_rng_state(state["rng"])
    else:
        sampler.skip(state["batches_drawn"])
    return resume


def _placement(cfg: Config, *, join: bool) -> Placement:
    """One process, or one rank of a site (worker.site, under torchrun) holding the whole model or
    (worker.site_sharding=fsdp) a shard of it: placement.py. A site's collectives wait for its
    slowest rank's round (comm/bounds.py)."""
    site_timeout_s = site_limit_s(cfg.comm.deadline_s)
    placement = placement_for(cfg.worker, _device(cfg.worker.device), site_timeout_s=site_timeout_s)
    if join:
        placement.check_join()
    return placement


def _data(cfg: Config, *, ranks: int) -> tuple[ShardSampler, list, int]:
    """This worker's shard of the train split, the held-out batches every worker shares, and the
    corpus's vocabulary size."""
    corpus = load_corpus(cfg.data)
    sampler = ShardSampler(
        corpus.train,
        block_size=cfg.model.block_size,
        batch_size=cfg.inner.batch_size * ranks,  # a site draws one batch for all its ranks; each takes its slice
        shard_index=cfg.worker.index,
        num_shards=cfg.worker.shards,
        seed=cfg.seed,
        chunk=cfg.data.shard_chunk,
    )
    held_out = val_batches(
        corpus.val,
        block_size=cfg.model.block_size,
        batch_size=cfg.logging.eval_batch_size,
        num_batches=cfg.logging.eval_batches,
        seed=cfg.seed,
    )
    return sampler, held_out, corpus.vocab_size


def _build_trained(cfg: Config, placement: Placement, *, vocab_size: int) -> _Trained:
    """The model and its optimizers; the same seed gives every worker the same initial params."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, vocab_size=vocab_size)
    synced_local = placement.place(model)  # what the outer step averages: the params, or this rank's shards
    inner_optimizer = build_inner_optimizer(cfg.inner, model)
    codec = build_codec(cfg.compression)  # how pseudo-gradients travel
    error_feedback = ErrorFeedback(codec, enabled=cfg.compression.error_feedback, decay=cfg.compression.error_decay)
    outer = OuterStep(synced_local, cfg.outer, error_feedback=error_feedback)
    if cfg.worker.compile:  # in place, after the optimizers: same params, same state_dict keys
        model.compile()
    torch.manual_seed(cfg.seed * 1000 + cfg.worker.index)  # dropout differs per worker
    return _Trained(model, inner_optimizer, error_feedback, outer)


def _transport_opener(cfg: Config, trained: _Trained, device: torch.device) -> Callable[[CommConfig], CommBackend]:
    """How this worker opens its transport (``placement.connect`` calls it on the ranks that talk
    to other workers), with the faults of ``cfg.faults`` around it."""
    outer, codec = trained.outer, trained.error_feedback.codec

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
            state_dir=checkpoint_folder(cfg.run_dir / "checkpoints", cfg.worker.index),
        )
        return with_faults(transport, cfg.faults, cfg.worker.index)

    return open_transport


def _worker_log(cfg: Config, placement: Placement, run_dir: Path, *, wall_s_before: float) -> WorkerLog:
    """The worker's records; only a site's leader writes to wandb."""
    return WorkerLog(
        cfg.logging if placement.leader else replace(cfg.logging, wandb="disabled"),
        run_dir=run_dir,
        run_name=cfg.run.name,
        worker_index=cfg.worker.index,
        total_steps=cfg.inner.steps,
        tokens_per_step=cfg.inner.batch_size * cfg.model.block_size * placement.ranks,
        config_dict=to_dict(cfg),
        wall_s_before=wall_s_before,
    )


def _round_clock(cfg: Config) -> RoundClock:
    """A round every outer.sync_every inner steps (or outer.round_s seconds); the data-parallel
    baseline (sync_every 0) records one every logging.eval_every steps."""
    return RoundClock(
        sync_every=cfg.outer.sync_every or cfg.logging.eval_every,
        round_s=cfg.outer.round_s,
        total_steps=cfg.inner.steps,
    )


def _sync_mode(
    cfg: Config, trained: _Trained, backend: CommBackend, accounting: Accounting, watchdog: Watchdog, *, join: bool
) -> SyncMode:
    """The worker's rounds (sync_modes.py): data-parallel (outer.sync_every=0), overlapped
    (outer.overlap=delayed|streaming) or blocking."""
    model, outer = trained.model, trained.outer
    deadline_s, workers, timed = cfg.comm.deadline_s, cfg.worker.count, cfg.outer.round_s > 0
    if cfg.outer.sync_every == 0:
        weight = cfg.inner.batch_size
        averaging = GradientAveraging(list(model.parameters()), backend.averaging, weight=weight, deadline_s=deadline_s)
        return DataParallelRounds(averaging, accounting)
    if cfg.outer.overlap != "none":
        overlapped = OverlappedOuter(outer, backend.averaging, cfg.outer, deadline_s=deadline_s, expected_peers=workers)
        return OverlappedRounds(
            overlapped, accounting, watchdog, samples_per_step=cfg.inner.batch_size, total_steps=cfg.inner.steps
        )

    def catch_up(step: int, round_index: int) -> tuple[int, int]:
        return catch_up_with_run(
            outer, backend.membership, step, round_index, cfg=cfg, required=join, align_step=not timed
        )

    return BlockingRounds(
        outer,
        backend.averaging,
        accounting,
        watchdog,
        catch_up=catch_up,
        worker_index=cfg.worker.index,
        deadline_s=deadline_s,
        expected_peers=workers,
        steps_per_round=0 if timed else cfg.outer.sync_every,
        total_steps=cfg.inner.steps,
    )


def _load_model_state(model: torch.nn.Module, saved: dict, checkpoints: Path) -> None:
    try:
        model.load_state_dict(saved)
    except RuntimeError as error:  # another architecture or size: a long message from torch
        detail = next((line.strip() for line in str(error).splitlines()[1:] if line.strip()), str(error))
        raise ConfigError(
            f"the checkpoint in {checkpoints} is of another model ({detail.rstrip('.')}): "
            f"resume with the run's own config (its config.yaml), or start afresh in another run.dir"
        ) from None


def _claim_memory(cfg: Config, device: torch.device, *, vocab_size: int) -> None:
    """This worker's share of its GPU (``worker.gpu_memory_fraction``), and the refusal of a model
    that cannot fit in it or in the host's memory (memory.py), before anything is allocated."""
    if device.type == "cuda" and cfg.worker.gpu_memory_fraction:  # workers sharing a GPU: each its share
        torch.cuda.set_per_process_memory_fraction(cfg.worker.gpu_memory_fraction, device)
    check_model_fits(
        cfg.model,
        vocab_size=vocab_size,
        device=device,
        batch_size=cfg.inner.batch_size,
        precision=cfg.worker.precision,
        global_on_gpu=cfg.outer.global_device == "model",
        gpu_share=cfg.worker.gpu_memory_fraction,
    )


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("worker.device=cuda but no CUDA device is visible; use worker.device=cpu or auto")
    return torch.device(name)
