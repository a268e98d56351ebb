"""A worker's records written as a worker writes them (``WorkerLog``), for the tests of what reads
them: the summary, the outcome of a run, the plot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from diloco.comm.base import Outcome, SyncResult
from diloco.config import LoggingConfig
from diloco.worker.metrics import JsonlWriter, start_record
from diloco.worker.records import Totals, WorkerLog


def worker_log(run_dir: Path, worker: int) -> WorkerLog:
    """Worker ``worker``'s records in ``run_dir``, its clock at 5 s (as a resumed worker's)."""
    return WorkerLog(
        LoggingConfig(wandb="disabled"),
        run_dir=run_dir,
        run_name="r",
        worker_index=worker,
        total_steps=10,
        tokens_per_step=10,
        config_dict={},
        wall_s_before=5.0,
    )


def write_session(
    run_dir: Path,
    worker: int,
    *,
    finished: bool = True,
    digest: str = "ab" * 32,
    val_loss: float = 2.0,
    rounds: int = 1,
) -> None:
    """One session of a worker: its start, 10 inner steps a round (a step record every 5), a round
    record after each round and, if ``finished``, its end record."""
    log = worker_log(run_dir, worker)
    step = 0
    for round_number in range(1, rounds + 1):
        for _ in range(10):
            step += 1
            log.count_step(step, round_number - 1, due=step % 5 == 0)
            log.write_step({"loss": torch.tensor(3.0), "lr": 1e-3})
        result = SyncResult(Outcome.AVERAGED, 2, 2.0, bytes_sent=100 * round_number)
        log.round(round_number, step, result, comm_s=0.1, recovered=False, val_loss=val_loss, param_hash=digest)
    if finished:
        log.end(step, rounds, Totals(), val_loss=val_loss, param_hash=digest)
    log.close()


def mark_start_of_a_gone_process(run_dir: Path, worker: int) -> None:
    """A session of worker ``worker`` opened by a process that has exited (without an end record)."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with JsonlWriter(run_dir, worker) as writer:
        writer.log({**start_record(worker), "pid": int(gone.stdout)})
