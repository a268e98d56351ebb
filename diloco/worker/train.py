"""``diloco train``'s worker, top to bottom: its language model, data and loop inside ``DiLoCo``
(wrapper.py), the same object a user's own script uses (its set-up from the config: lm_task.py).

    diloco train configs/tiny.yaml                                   # first worker of a new run
    diloco train configs/tiny.yaml worker.index=1 worker.count=2 \\
        comm.hivemind.initial_peers="['/ip4/10.0.0.1/tcp/31337/p2p/12D3Koo...']"  # join it

Every ``outer.sync_every`` inner steps the worker averages its pseudo-gradient with the others
and takes an outer step (``OuterStep.sync`` in core/outer.py); overlapped and data-parallel
rounds plug into the same loop (sync_modes.py). After each round it evaluates on the
held-out batches every worker shares (the workers that hold the same params split them where the
transport offers it: core/shared_evaluation.py), logs a round record (with the hash of the global params,
which every worker must agree on) and checkpoints. Rerunning the same command resumes from the
newest checkpoint. ``run_worker`` is the command itself: the config, the run, and the lines it
prints on the way (the address to join by, how it ended) and its exit code.
"""

from __future__ import annotations

import torch

from diloco.config import Config
from diloco.config.trust import trust_line
from diloco.core.evaluation import batch_losses
from diloco.core.inner import inner_step, lr_at
from diloco.worker.faults import StopRequested
from diloco.worker.lm_task import LanguageModelTask, build_task
from diloco.worker.metrics import write_summary
from diloco.worker.run import Run, worker_config
from diloco.worker.wrapper import DiLoCo


def train(cfg: Config, *, on_ready=None, join: bool = False) -> dict:
    """Run one worker to the end; return its end record. Stopped at ``faults.stop_after_round``, it
    raises ``StopRequested`` instead (``run_worker`` reports it).

    ``on_ready(addresses)`` is called once the worker is reachable by peers. A worker whose peers
    are rounds ahead (it joins a live run, or restarts from an old checkpoint) first takes their
    state (``joining.py``); with ``join`` a live run is required (``JoinError`` when none is found).
    """
    run = Run.from_config(cfg, join=join)
    task = build_task(run)  # data, model, inner optimizer: lm_task.py
    placement = run.placement

    def held_out_loss() -> float:
        synced = dl.model_is_synced and dl.params_digest is not None  # after a round: its digest keys a cache
        params_key = (dl.params_digest, task.held_out_hash) if synced else None
        return placement.evaluate(task.model, task.held_out, params_key)

    dl = DiLoCo(
        run,
        task.model,
        task.inner_optimizer,
        evaluate=held_out_loss,  # where the batches are not split
        batch_losses=lambda indices: batch_losses(task.model, task.held_out, indices),
        eval_batches=len(task.held_out),
        state={"sampler": task.sampler},
        hook=False,  # the gradient averaging of a site goes before clipping, inside inner_step
        samples_per_step=task.samples_per_step,
        tokens_per_step=task.tokens_per_step,
        on_ready=on_ready,
    )
    with dl:
        task.follow(dl.resumed)  # resumed from another worker's checkpoint: as far along in its own data
        while dl.running:
            loss, lr = _inner_step(dl, task, cfg)
            dl.after_step()  # at a round's end: average, outer step, evaluate, record, checkpoint
            dl.log(loss=loss, lr=lr)
    return dl.result


def _inner_step(dl: DiLoCo, task: LanguageModelTask, cfg: Config) -> tuple[torch.Tensor, float]:
    """One inner step on the worker's next batch (on a site, its rank's slice): (loss as a tensor, lr)."""
    lr = lr_at(cfg.inner, dl.schedule_step)
    batch_tensors = dl.run.placement.my_slice(task.sampler.next_batch())
    loss = inner_step(
        task.model,
        task.inner_optimizer,
        [t.to(dl.run.device, non_blocking=True) for t in batch_tensors],
        lr=lr,
        grad_clip=cfg.inner.grad_clip,
        average_gradients=dl.average_gradients,
        precision=cfg.worker.precision,
    )
    return loss, lr


def run_worker(config_path: str | None, overrides: list[str], *, join: bool = False) -> int:
    """``diloco train`` (``join``: ``diloco join``, once placed): one worker of ``config_path`` with
    ``overrides`` from start to end; its exit code (3: stopped by ``faults.stop_after_round``)."""
    cfg = worker_config(config_path, overrides)  # under torchrun: each rank a worker, unless one site
    print(trust_line(cfg), flush=True)  # the run's first line: how far it trusts its workers, and why

    def announce(addresses: list[str]) -> None:
        if addresses:
            peers = ",".join(f"'{a}'" for a in addresses)
            print(
                f"worker {cfg.worker.index} is up; join this run with: comm.hivemind.initial_peers=[{peers}]",
                flush=True,
            )

    try:
        end = train(cfg, on_ready=announce, join=join)
    except KeyboardInterrupt:  # train() marked the worker as leaving and stopped its peers
        raise KeyboardInterrupt(
            f"worker {cfg.worker.index} left the run; the same command again resumes it from its last checkpoint"
        ) from None
    except StopRequested as stop:
        print(f"worker {cfg.worker.index} stopped: {stop}", flush=True)
        write_summary(cfg.run_dir, errors={cfg.worker.index: f"stopped: {stop}"}, unless_running=True)
        return 3
    write_summary(cfg.run_dir, unless_running=True)  # the directory's: the last of its workers to end writes it
    print(
        f"worker {cfg.worker.index} finished: {end['inner_steps']} steps, {end['rounds']} rounds, "
        f"val_loss {end['val_loss']:.4f}, params {end['param_sha256'][:16]}",
        flush=True,
    )
    return 0
