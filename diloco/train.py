"""One DiLoCo worker, top to bottom: config, data, model, optimizers, transport, one loop.

    diloco train configs/tiny.yaml                                   # first worker of a new run
    diloco train configs/tiny.yaml worker.index=1 worker.count=2 \\
        comm.initial_peers='["/ip4/10.0.0.1/tcp/31337/p2p/12D3Koo..."]'  # join it

Every ``outer.sync_every`` inner steps the worker averages its pseudo-gradient with the others
and takes an outer step (``OuterStep.sync`` in outer.py). After each round it evaluates on the
shared held-out batches, logs a round record (with the hash of the global params, which every
worker must agree on), and checkpoints. Rerunning the same command resumes from the newest
checkpoint.
"""

from __future__ import annotations

import logging
import time

import torch

from diloco.checkpoint import capture_rng_state, load_latest_checkpoint, restore_rng_state, save_checkpoint
from diloco.comm import build_backend
from diloco.config import Config, save_config, to_dict
from diloco.data import ShardSampler, evaluate, load_corpus, val_batches
from diloco.faults import check_stop, with_faults
from diloco.inner import build_inner_optimizer, inner_step, lr_at
from diloco.metrics import JsonlWriter, build_wandb_logger, param_sha256
from diloco.model import build_model
from diloco.outer import OuterStep

logger = logging.getLogger(__name__)


def train(cfg: Config, *, on_ready=None) -> dict:
    """Run one worker to the end (or to ``faults.stop_after_round``); return its end record.

    ``on_ready(addresses)`` is called once the worker is reachable by peers.
    """
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.worker.index == 0:
        save_config(cfg, run_dir / "config.yaml")
    if cfg.worker.threads:
        torch.set_num_threads(cfg.worker.threads)

    # data: this worker's shard of the train split, and the held-out batches every worker shares
    corpus = load_corpus(cfg.data)
    sampler = ShardSampler(
        corpus.train,
        block_size=cfg.model.block_size,
        batch_size=cfg.inner.batch_size,
        shard_index=cfg.worker.index,
        num_shards=cfg.worker.count,
        seed=cfg.seed,
    )
    held_out = val_batches(
        corpus.val,
        block_size=cfg.model.block_size,
        batch_size=cfg.inner.batch_size,
        num_batches=cfg.logging.eval_batches,
        seed=cfg.seed,
    )

    # model: the same seed gives every worker the same initial params
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    inner_optimizer = build_inner_optimizer(cfg.inner, model)
    outer = OuterStep(list(model.parameters()), cfg.outer)
    torch.manual_seed(cfg.seed * 1000 + cfg.worker.index)  # dropout differs per worker

    step, round_index, totals = 0, 0, {"compute_s": 0.0, "comm_wait_s": 0.0, "bytes_sent": 0, "bytes_recv": 0}
    checkpoints = run_dir / "checkpoints"
    state = load_latest_checkpoint(checkpoints, cfg.worker.index)
    if state is not None:
        model.load_state_dict(state["model"])
        inner_optimizer.load_state_dict(state["inner_optimizer"])
        outer.load_state_dict(state["outer"])
        sampler.load_state_dict(state["sampler"])
        restore_rng_state(state["rng"])
        step, round_index, totals = state["step"], state["round"], state["totals"]
        logger.info("worker %d resumed at step %d, round %d", cfg.worker.index, step, round_index)

    H = cfg.outer.sync_every
    tokens_per_step = cfg.inner.batch_size * cfg.model.block_size
    wall_start = time.perf_counter() - totals.get("wall_s", 0.0)
    backend = build_backend(cfg.comm, templates=outer.global_params, num_workers=cfg.worker.count)
    backend = with_faults(backend, cfg.faults, cfg.worker.index)
    records = JsonlWriter(run_dir, cfg.worker.index)
    wandb = build_wandb_logger(
        cfg.logging,
        run_dir=run_dir,
        run_name=cfg.run.name,
        worker_index=cfg.worker.index,
        config_dict=to_dict(cfg),
    )
    try:
        if on_ready is not None:
            on_ready(backend.addresses)
        window_start, window_steps, samples_this_round = time.perf_counter(), 0, 0
        while step < cfg.inner.steps:
            # ---- inner step -------------------------------------------------------------
            started = time.perf_counter()
            lr = lr_at(cfg.inner, step)
            loss = inner_step(
                model, inner_optimizer, sampler.next_batch(), lr=lr, grad_clip=cfg.inner.grad_clip
            )
            step += 1
            samples_this_round += cfg.inner.batch_size
            totals["compute_s"] += time.perf_counter() - started
            window_steps += 1
            if step % cfg.logging.log_every == 0:
                tokens_per_s = window_steps * tokens_per_step / (time.perf_counter() - window_start)
                record = {
                    "event": "step",
                    "step": step,
                    "round": round_index,
                    "loss": loss.item(),
                    "lr": lr,
                    "tokens_per_s": round(tokens_per_s, 1),
                }
                records.log(record)
                wandb.log(record, step=step)
                logger.info(
                    "step %d/%d  round %d  loss %.4f  %.0f tokens/s",
                    step,
                    cfg.inner.steps,
                    round_index,
                    record["loss"],
                    tokens_per_s,
                )
                window_start, window_steps = time.perf_counter(), 0

            # ---- outer step: every H inner steps, and once more at the end ------------------
            if step % H != 0 and step != cfg.inner.steps:
                continue
            started = time.perf_counter()
            result, recovered = outer.sync(
                backend,
                weight=samples_this_round,
                round_index=round_index,
                deadline_s=cfg.comm.deadline_s,
                expected_peers=cfg.worker.count,
            )
            comm_s = time.perf_counter() - started
            totals["comm_wait_s"] += comm_s
            totals["bytes_sent"] += result.bytes_sent
            totals["bytes_recv"] += result.bytes_recv
            round_index += 1
            samples_this_round = 0
            record = {
                "event": "round",
                "round": round_index,
                "step": step,
                "val_loss": evaluate(model, held_out),
                "peers": result.peers,
                "ok": result.ok,
                "recovered": recovered,
                "bytes_sent": result.bytes_sent,
                "bytes_recv": result.bytes_recv,
                "comm_s": round(comm_s, 4),
                "param_sha256": param_sha256(outer.global_params),
                "tokens": step * tokens_per_step,
            }
            if result.error:
                record["error"] = result.error
            logger.info(
                "round %d: val_loss %.4f  peers %d  %.2f s  %d bytes sent  params %s",
                round_index,
                record["val_loss"],
                result.peers,
                comm_s,
                result.bytes_sent,
                record["param_sha256"][:12],
            )
            records.log(record)
            wandb.log(record, step=step)
            window_start = time.perf_counter()  # the sync is not part of the next window's throughput

            every = cfg.checkpoint.every_rounds
            if every and (round_index % every == 0 or step == cfg.inner.steps):
                totals["wall_s"] = time.perf_counter() - wall_start
                save_checkpoint(
                    checkpoints,
                    cfg.worker.index,
                    round_index,
                    {
                        "model": model.state_dict(),
                        "inner_optimizer": inner_optimizer.state_dict(),
                        "outer": outer.state_dict(),
                        "sampler": sampler.state_dict(),
                        "rng": capture_rng_state(),
                        "step": step,
                        "round": round_index,
                        "totals": dict(totals),
                    },
                    keep=cfg.checkpoint.keep,
                )
            check_stop(cfg.faults, cfg.worker.index, round_index)

        end = {
            "event": "end",
            "worker": cfg.worker.index,
            "inner_steps": step,
            "rounds": round_index,
            "tokens": step * tokens_per_step,
            "val_loss": evaluate(model, held_out),
            "bytes_sent": totals["bytes_sent"],
            "bytes_recv": totals["bytes_recv"],
            "compute_s": round(totals["compute_s"], 3),
            "comm_wait_s": round(totals["comm_wait_s"], 3),
            "wall_s": round(time.perf_counter() - wall_start, 3),
            "param_sha256": param_sha256(outer.global_params),
        }
        records.log(end)
        wandb.log({k: v for k, v in end.items() if isinstance(v, int | float)}, step=step)
        return end
    finally:
        records.close()
        wandb.finish()
        backend.shutdown()
