"""A worker set up around a model and its inner optimizer (the user's, or ``diloco train``'s:
lm_task.py): the outer step, the codec, the resumed state, the transport, its records and how its
rounds sync. ``DiLoCo`` (wrapper.py) drives what ``build_worker`` returns.

Rerunning the same command resumes from the newest valid checkpoint (or, when the worker's own
newest is damaged, the newest usable state: resume.py): ``Worker.state_dict`` lists what a
checkpoint holds once, and ``build_worker`` loads it back part by part.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from diloco.comm import CommBackend, CommConfig, build_backend
from diloco.comm.bounds import phase_bounds
from diloco.compression import ErrorFeedback, build_codec
from diloco.config import Config, ConfigError, save_config, to_dict
from diloco.core.outer import GradientAveraging, OuterStep
from diloco.core.overlap import OverlappedOuter, fragments_for
from diloco.core.recovery import Recovery
from diloco.core.rounds import RoundClock
from diloco.errors import make_folder
from diloco.worker.checkpoint import CheckpointWriter, capture_rng_state, checkpoint_folder, restore_rng_state
from diloco.worker.faults import with_bad_payloads, with_faults
from diloco.worker.joining import Joining, model_digest, published_run
from diloco.worker.placement import Placement
from diloco.worker.records import Totals, WorkerLog, totals_state
from diloco.worker.resume import Resume, choose_resume, model_shapes, told
from diloco.worker.sync_modes import Accounting, BlockingRounds, DataParallelRounds, OverlappedRounds, SyncMode
from diloco.worker.watchdog import Watchdog

logger = logging.getLogger(__name__)


@dataclass
class Trained:
    """What training changes: the model and its inner optimizer (the user's), and ours around
    them; built alike on every worker from the seed. A checkpoint holds each, and ``extra``: the
    user's objects with a ``state_dict`` (``diloco train``'s data position), restored with the
    worker's own checkpoint."""

    model: torch.nn.Module
    inner_optimizer: torch.optim.Optimizer
    error_feedback: ErrorFeedback
    outer: OuterStep
    extra: dict[str, Any] = field(default_factory=dict)

    def load_state_dict(self, state: dict, checkpoints: Path, *, own: bool) -> None:
        """``Worker.state_dict``'s parts read back, before the transport starts (a checkpoint of
        another model is refused at once); ``own``: the worker's own checkpoint (its data
        position and RNG with it), not another worker's."""
        _load_model_state(self.model, state["model"], checkpoints)
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.outer.load_state_dict(state["outer"])
        self.error_feedback.load_state_dict(state.get("error_feedback", {}))
        if own:
            for name, item in self.extra.items():
                if name in state:
                    item.load_state_dict(state[name])
            restore_rng_state(state["rng"])


# the parts of a checkpoint that hold the model's state, loaded into the model and the optimizers
_LOADED_PARTS = ("model", "inner_optimizer", "outer", "error_feedback")
# the parts of a checkpoint the outer step changes
_OUTER_PARTS = ("outer", "error_feedback", "overlap")
# the parts of a checkpoint that are diloco's own (``Worker.state_dict``): a user's ``extra`` takes other names
OWN_PARTS = ("model", "inner_optimizer", "outer", "error_feedback", "overlap", "rng", "step", "round", "totals")


@dataclass
class Worker:
    """Everything a worker's rounds use. ``start_step`` and ``start_round`` are where it starts
    (0 for a new run, the checkpoint's for a resumed one); ``totals`` go on from there."""

    cfg: Config
    placement: Placement  # one process, or a rank of a site (placement.py)
    trained: Trained  # the model, its inner optimizer, the outer step (core/outer.py), the codec's residual
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

    def __post_init__(self) -> None:
        # the inner optimizer's update changes the model: a checkpoint being written has it first
        # (an optimizer without step hooks: the checkpoint copies them instead)
        optimizer = _hookable(self.trained.inner_optimizer)
        self._before_update = (
            None if optimizer is None else optimizer.register_step_pre_hook(lambda *_: self.wait_for_checkpoint("step"))
        )

    def state_dict(self, step: int, round_index: int) -> dict:
        """What a checkpoint after round ``round_index`` holds (a sharded site's rank: its own shards)."""
        trained = self.trained
        state = {
            "model": trained.outer.model_state(trained.model),
            "inner_optimizer": trained.inner_optimizer.state_dict(),
            "outer": trained.outer.state_dict(copy=False),  # written live (checkpoint_file.py)
            "error_feedback": trained.error_feedback.state_dict(),
            "overlap": self.sync.state_dict(),
            **{name: item.state_dict() for name, item in trained.extra.items()},
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
        """Checkpoint the state after round ``round_index``, written in the background from the live
        tensors: the next inner update waits for the model and its optimizer's part to be written,
        the next round's end for the outer step's (``checkpoint_file.py``)."""
        # blocking rounds change the global state only at a round's end; overlapped ones within steps,
        # after the update. Parts written live must be waited for: an inner optimizer without step
        # hooks gets no wait, and what it changes is copied instead
        live = dict.fromkeys(_OUTER_PARTS, "round") if self.sync.outer_changes_at_round_end else {}
        if self._before_update is not None:
            live = dict.fromkeys((*_OUTER_PARTS, "model", "inner_optimizer"), "step") | live
        with self.watchdog.phase("checkpointing"):
            self.checkpoints.save(round_index, self.state_dict(step, round_index), live=live)

    def wait_for_checkpoint(self, group: str) -> None:
        """Before what changes the parts of ``group`` ("step": the inner update; "round": a round's
        end): until the checkpoint being written has them on their way to disk."""
        if self.checkpoints.writing(group):
            with self.watchdog.phase("checkpointing"):
                self.checkpoints.wait_for(group)

    def close(self) -> None:
        """Stop everything the worker started; the run is told it left, and the transport shut down,
        whatever fails before."""
        with contextlib.ExitStack() as stack:
            stack.callback(self.backend.shutdown)
            if self._before_update is not None:
                stack.callback(self._before_update.remove)
            stack.callback(self.backend.membership.leave)
            stack.callback(self.log.close)
            stack.callback(self.watchdog.stop)
            try:
                self.checkpoints.wait()  # a write in progress ends whole (a crash mid-write loses only it)
            except Exception:
                logger.exception("the last checkpoint could not be written")


def build_worker(
    cfg: Config,
    placement: Placement,
    model: torch.nn.Module,
    inner_optimizer: torch.optim.Optimizer,
    *,
    synced_params: list[torch.Tensor],
    extra: dict[str, Any],
    samples_per_step: int,
    tokens_per_step: int,
    join: bool = False,
) -> Worker:
    """Set up one worker around ``model`` and ``inner_optimizer`` (``synced_params``: what its outer
    step averages; ``extra``: more to checkpoint; ``samples_per_step``: a step's weight in an average),
    resumed from its newest checkpoint if it has one. With ``join`` a live run is required (checked
    before the first step, ``joining.py``)."""
    run_dir = placement.run_dir(cfg.run_dir)  # each rank of a site has its own records
    make_folder(run_dir, "run.dir", ConfigError)
    trained = _around(cfg, model, inner_optimizer, synced_params, extra)
    # its params' names and shapes, which every worker's must match (a site's ranks hold shards)
    model_id = model_digest(model_shapes(model)) if placement.ranks == 1 else ""

    resume = _resumed(cfg, placement, trained, run_dir)
    step, round_index, totals = _start_of(resume.state)

    # a site's ranks connect through the site
    backend = placement.connect(cfg.comm, _transport_opener(cfg, trained, placement.device))
    with contextlib.ExitStack() as undo:  # should a step below fail, what started is stopped again
        undo.callback(backend.shutdown)
        undo.callback(backend.membership.leave)
        # what a newcomer's config and model must match, and the config
        backend.membership.announce_run(published_run(cfg, model=model_id))
        log = _worker_log(cfg, placement, run_dir, tokens_per_step=tokens_per_step, wall_s_before=totals.wall_s)
        undo.callback(log.close)
        watchdog = _watchdog(cfg, run_dir, backend)
        undo.callback(watchdog.stop)
        accounting = Accounting(totals, log)
        sync = _sync_mode(
            cfg, trained, backend, accounting, watchdog, samples_per_step=samples_per_step, join=join, model_id=model_id
        )
        sync.load_state_dict(resume.state.get("overlap") if resume.state is not None else None)
        worker = Worker(
            cfg=cfg,
            placement=placement,
            trained=trained,
            backend=backend,
            log=log,
            watchdog=watchdog,
            clock=_round_clock(cfg),
            sync=sync,
            average_gradients=placement.site_gradient_hook(model) or sync.average_gradients,
            checkpoints=CheckpointWriter(run_dir / "checkpoints", cfg.worker.index, keep=cfg.checkpoint.keep),
            start_step=step,
            start_round=round_index,
            totals=totals,
            resume=resume,
        )
        undo.pop_all()  # all set: they are the worker's to close (Worker.close)
    return worker


def _around(
    cfg: Config,
    model: torch.nn.Module,
    inner_optimizer: torch.optim.Optimizer,
    synced_params: list[torch.Tensor],
    extra: dict[str, Any],
) -> Trained:
    """The outer step over ``synced_params`` and the codec's residual, around the model."""
    codec = build_codec(cfg.compression)  # how pseudo-gradients travel
    error_feedback = ErrorFeedback(codec, enabled=cfg.compression.error_feedback, decay=cfg.compression.error_decay)
    outer = OuterStep(synced_params, cfg.outer, error_feedback=error_feedback)
    return Trained(model, inner_optimizer, error_feedback, outer, extra)


def _resumed(cfg: Config, placement: Placement, trained: Trained, run_dir: Path) -> Resume:
    """What the worker resumes from: rerunning the same command continues from the newest valid
    checkpoint in ``run_dir`` (``_resume``). Worker 0 then saves the run's config (after the resume
    check: a mismatched config must not replace the run's)."""
    resume = _resume(cfg, placement, trained, run_dir / "checkpoints")
    if cfg.worker.index == 0:
        save_config(cfg, run_dir / "config.yaml")
    return resume


def _start_of(state: dict | None) -> tuple[int, int, Totals]:
    """The step, round and totals the worker starts from: those of the resumed ``state``, or none yet."""
    step, round_index = (state["step"], state["round"]) if state else (0, 0)
    return step, round_index, Totals(**state["totals"]) if state else Totals()


def _watchdog(cfg: Config, run_dir: Path, backend: CommBackend) -> Watchdog:
    """The worker's watchdog: its phases bounded by the run's deadlines, each told to the run
    (``diloco status``), thread stacks written in ``run_dir`` when a phase passes its bound."""
    return Watchdog(
        phase_bounds(cfg.comm.deadline_s, cfg.comm.hivemind.matchmaking_s),
        stacks_path=run_dir / f"stacks-worker-{cfg.worker.index}.txt",
        on_phase=backend.membership.report_phase,
    )


def _resume(cfg: Config, placement: Placement, trained: Trained, checkpoints: Path) -> Resume:
    """The state chosen by ``choose_resume`` (resume.py), loaded: this worker's own whole, or
    what it takes of another worker's (then the caller rebuilds its data position on its own
    shard; its RNG stays its seed's). Only one process holding the whole model takes another
    worker's checkpoint."""
    shapes = model_shapes(trained.model) if placement.ranks == 1 else None
    resume = choose_resume(checkpoints, cfg.worker.index, model_shapes=shapes)
    if (state := resume.state) is None:
        return resume
    placement.check_resume(checkpoints)
    trained.load_state_dict(state, checkpoints, own=resume.own)
    # what is loaded now lives in the model and the optimizers: the parts read from disk are let go
    return replace(resume, state={key: value for key, value in state.items() if key not in _LOADED_PARTS})


def _transport_opener(cfg: Config, trained: Trained, device: torch.device) -> Callable[[CommConfig], CommBackend]:
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


def _worker_log(
    cfg: Config, placement: Placement, run_dir: Path, *, tokens_per_step: int, wall_s_before: float
) -> WorkerLog:
    """The worker's records; only a site's leader writes to wandb."""
    return WorkerLog(
        cfg.logging if placement.leader else replace(cfg.logging, wandb="disabled"),
        run_dir=run_dir,
        run_name=cfg.run.name,
        worker_index=cfg.worker.index,
        total_steps=cfg.inner.steps,
        tokens_per_step=tokens_per_step,
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
    cfg: Config,
    trained: Trained,
    backend: CommBackend,
    accounting: Accounting,
    watchdog: Watchdog,
    *,
    samples_per_step: int,
    join: bool,
    model_id: str,
) -> SyncMode:
    """The worker's rounds (sync_modes.py): data-parallel (outer.sync_every=0), overlapped
    (outer.overlap=delayed|streaming) or blocking."""
    model, outer = trained.model, trained.outer
    # after a failed, partial or split round: whether the global state is the run's, and taking a peer's
    recovery = Recovery(outer, backend.states, backend.membership)
    deadline_s, workers, timed = cfg.comm.deadline_s, cfg.worker.count, cfg.outer.round_s > 0
    if cfg.outer.sync_every == 0:
        params = list(model.parameters())
        averaging = GradientAveraging(params, backend.averaging, weight=samples_per_step, deadline_s=deadline_s)
        return DataParallelRounds(averaging, accounting)
    if cfg.outer.overlap != "none":
        overlapped = OverlappedOuter(
            outer, backend.averaging, recovery, cfg.outer, deadline_s=deadline_s, expected_peers=workers
        )
        return OverlappedRounds(
            overlapped, accounting, watchdog, samples_per_step=samples_per_step, total_steps=cfg.inner.steps
        )

    joining = Joining(recovery, backend.membership, cfg, required=join, align_step=not timed, model=model_id)
    return BlockingRounds(
        outer,
        backend.averaging,
        recovery,
        accounting,
        watchdog,
        joining=joining,
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


def _hookable(optimizer: object) -> torch.optim.Optimizer | None:
    """The torch optimizer that takes step hooks, inside wrappers (Accelerate's holds it as
    ``.optimizer`` and skips the base class's set-up); None when there is none."""
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "_optimizer_step_pre_hooks"):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None
