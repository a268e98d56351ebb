"""One DiLoCo worker, top to bottom: config, data, model, optimizers, transport, one loop.

    diloco train configs/tiny.yaml                                   # first worker of a new run
    diloco train configs/tiny.yaml worker.index=1 worker.count=2 \\
        comm.initial_peers="['/ip4/10.0.0.1/tcp/31337/p2p/12D3Koo...']"  # join it

Every ``outer.sync_every`` inner steps the worker averages its pseudo-gradient with the others
and takes an outer step (``OuterStep.sync`` in outer.py). After each round it evaluates on the
held-out batches every worker shares, logs a round record (with the hash of the global params,
which every worker must agree on) and checkpoints. Rerunning the same command resumes from the
newest checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from diloco.comm import CommBackend, CommConfig, SyncResult, build_backend
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
from diloco.worker.records import RoundCost, Totals, WorkerLog, totals_state
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
    step, round_index, totals = 0, 0, Totals()
    checkpoints = run_dir / "checkpoints"
    if (state := load_latest_checkpoint(checkpoints, cfg.worker.index)) is not None:
        placement.check_resume(checkpoints)
        _load_model_state(model, state["model"], checkpoints)
        inner_optimizer.load_state_dict(state["inner_optimizer"])
        outer.load_state_dict(state["outer"])
        error_feedback.load_state_dict(state.get("error_feedback", {}))
        sampler.load_state_dict(state["sampler"])
        restore_rng_state(state["rng"])
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
    # the data-parallel baseline (outer.sync_every=0) averages gradients inside every inner step
    # and records a round every logging.eval_every steps; DiLoCo records each outer round
    data_parallel = cfg.outer.sync_every == 0
    gradient_averaging = (
        GradientAveraging(list(model.parameters()), backend, weight=batch, deadline_s=cfg.comm.deadline_s)
        if data_parallel
        else None
    )
    # outer.overlap=delayed|streaming: averages run in the background and are applied inner steps later
    overlapped = (
        OverlappedOuter(outer, backend, cfg.outer, deadline_s=cfg.comm.deadline_s, expected_peers=cfg.worker.count)
        if cfg.outer.overlap != "none"
        else None
    )
    if overlapped is not None and state is not None and state.get("overlap"):
        overlapped.load_state_dict(state["overlap"])
    # what the worker is doing, for diloco status; a warning when a phase outlasts its bound
    watchdog = Watchdog(
        phase_bounds(cfg.comm.deadline_s, cfg.comm.matchmaking_s),
        stacks_path=run_dir / f"stacks-worker-{cfg.worker.index}.txt",
        on_phase=backend.report_phase,
    )
    record_every = cfg.logging.eval_every if data_parallel else cfg.outer.sync_every
    clock = RoundClock(sync_every=record_every, round_s=cfg.outer.round_s, total_steps=cfg.inner.steps)
    synced_params = list(model.parameters()) if data_parallel else outer.global_params
    # between backward and the update: the data-parallel baseline's averaging, or a site's, inside it
    average_gradients = placement.site_gradient_hook(model) or gradient_averaging

    checkpoint_writer = CheckpointWriter(checkpoints, cfg.worker.index, keep=cfg.checkpoint.keep)

    def save_worker_state(step: int, round_index: int) -> None:
        worker_state = {
            "model": model.state_dict(),
            "inner_optimizer": inner_optimizer.state_dict(),
            "outer": outer.state_dict(copy=False),  # the writer copies it (once)
            "error_feedback": error_feedback.state_dict(),
            "overlap": overlapped.state_dict() if overlapped is not None else None,
            "sampler": sampler.state_dict(),
            "rng": capture_rng_state(),
            "step": step,
            "round": round_index,
            "totals": totals_state(totals, log),
        }
        worker_state = placement.checkpoint_state(worker_state)  # a sharded site's rank: its own shards
        checkpoint_writer.save(round_index, worker_state)  # a snapshot, written in the background

    try:
        if on_ready is not None:
            on_ready(backend.addresses)
        if not data_parallel and overlapped is None:
            behind = round_index
            with watchdog.phase("downloading state"):
                step, round_index = catch_up_with_run(
                    outer, backend, step, round_index, cfg=cfg, required=join, align_step=not clock.timed
                )
            if round_index != behind and not clock.running(step, round_index) and cfg.checkpoint.every_rounds:
                with watchdog.phase("checkpointing"):  # took the run's final state: it is this worker's last
                    save_worker_state(step, round_index)
        samples_this_round, window, val_loss, unattributed_comm_s = 0, [], None, 0.0
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
            step_s = time.perf_counter() - started
            if gradient_averaging is not None:
                for result, measured_s in gradient_averaging.take_rounds():
                    step_s -= measured_s
                    window.append(_account(result, measured_s, totals, log))
            totals.compute_s += step_s
            step += 1
            samples_this_round += batch * ranks
            backend.report_progress(round_index, step, log.live)
            if overlapped is not None:
                with watchdog.phase("averaging"):
                    costs, unattributed = _overlapped_step(overlapped, step, batch, cfg.inner.steps, totals, log)
                window.extend(costs)
                unattributed_comm_s += unattributed
            log.step(step, round_index, loss, lr, due=step % cfg.logging.log_every == 0)
            if not clock.round_ends(step):
                continue

            # ---- outer step: every H inner steps (or outer.round_s seconds), and at the end ----
            if data_parallel or overlapped is not None:
                result, recovered = _merge(window), any(cost.recovered for cost in window)
                comm_s = sum(r.comm_s for r in window) + unattributed_comm_s
                window, unattributed_comm_s = [], 0.0
            else:
                started = time.perf_counter()
                with watchdog.phase("averaging"):
                    result, taken_round = outer.sync(
                        backend,
                        weight=samples_this_round,
                        round_index=round_index,
                        deadline_s=cfg.comm.deadline_s,
                        expected_peers=cfg.worker.count,
                    )
                comm_s = _account(result, time.perf_counter() - started, totals, log).comm_s
                recovered = taken_round is not None
                if recovered and taken_round > round_index:  # the others are rounds ahead: skip to them
                    logger.warning(
                        "worker %d skips from round %d to %d", cfg.worker.index, round_index + 1, taken_round + 1
                    )
                    if not clock.timed:  # fixed rounds end at multiples of H: keep to them
                        step = min(cfg.inner.steps, step + (taken_round - round_index) * cfg.outer.sync_every)
                    round_index = taken_round
            round_index, samples_this_round = round_index + 1, 0
            backend.report_progress(round_index, step, log.live)
            clock.start_round()
            with watchdog.phase("hashing"):
                param_hash = param_sha256(synced_params)
            # overlapped, a worker's model is the global params plus its own progress: not a cache key
            params_key = (param_hash, held_out_hash) if overlapped is None else None
            with watchdog.phase("evaluating"):
                val_loss = placement.evaluate(model, held_out, params_key)
            log.round(
                round_index,
                step,
                result,
                comm_s=comm_s,
                recovered=recovered,
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
            param_hash=param_sha256(synced_params),
            param_count=sum(p.numel() for p in synced_params),
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


def _load_model_state(model: torch.nn.Module, saved: dict, checkpoints) -> None:
    try:
        model.load_state_dict(saved)
    except RuntimeError as error:  # another architecture or size: a long message from torch
        detail = next((line.strip() for line in str(error).splitlines()[1:] if line.strip()), str(error))
        raise ConfigError(
            f"the checkpoint in {checkpoints} is of another model ({detail.rstrip('.')}): "
            f"resume with the run's own config (its config.yaml), or start afresh in another run.dir"
        ) from None


def _account(result: SyncResult, measured_s: float, totals: Totals, log: WorkerLog) -> RoundCost:
    """Add a round to the totals. A simulated transport's modelled time replaces the time this
    thread actually waited (for its turn), in the totals and in the worker's wall clock."""
    comm_s = measured_s if result.simulated_s is None else result.simulated_s
    log.discount(measured_s - comm_s)
    totals.add_round(result, comm_s)
    return RoundCost(result, comm_s)


def _overlapped_step(
    overlapped: OverlappedOuter, step: int, batch: int, last_step: int, totals: Totals, log: WorkerLog
) -> tuple[list[RoundCost], float]:
    """Hand inner step ``step`` to the overlapped outer steps and account for what they did.

    Over a real transport all the time spent there is the outer step's (waiting for an average,
    and the local work around it). The simulator instead takes turns there: that time leaves the
    wall clock, and each average costs only its modelled time that compute did not hide. Returns
    the applied averages' costs, and the time spent when nothing was applied (starting a sync)."""
    started = time.perf_counter()
    applied = overlapped.after_inner_step(
        step, samples_per_step=batch, compute_s=totals.compute_s, final=step == last_step
    )
    spent = time.perf_counter() - started
    simulated = overlapped.backend.simulated
    comm_s = sum(a.wait_s for a in applied) if simulated else spent
    log.discount(spent - comm_s)
    costs = []
    for k, average in enumerate(applied):
        share = comm_s if k == 0 else 0.0  # the step's time goes to the first average applied in it
        totals.add_round(average.result, share)
        costs.append(RoundCost(average.result, share, average.recovered))
    if applied:
        return costs, 0.0
    totals.comm_wait_s += comm_s
    return costs, comm_s


def _merge(window: list[RoundCost]) -> SyncResult:
    """The data-parallel rounds since the last record, as one result."""
    results = [cost.result for cost in window]
    if not results:
        return SyncResult(ok=True, peers=1, total_weight=0.0)
    return SyncResult(
        ok=all(r.ok for r in results),
        peers=min(r.peers for r in results),
        total_weight=results[-1].total_weight,
        bytes_sent=sum(r.bytes_sent for r in results),
        bytes_recv=sum(r.bytes_recv for r in results),
        error=next((r.error for r in results if r.error), ""),
    )


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("worker.device=cuda but no CUDA device is visible; use worker.device=cpu or auto")
    return torch.device(name)
