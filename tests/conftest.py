"""Shared test fixtures: a tiny workload, and a runner for the real ``diloco`` command that
never leaves a process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.tools import warm_start

# One intra-op thread, here and in every process a test starts (they inherit the environment;
# TINY sets worker.threads=1 for the commands that would set their own): the tests' models are
# tiny, and on a 2-core machine running several processes at once, 2 threads a process make them
# spin-wait on each other (a one-worker run of TINY took 28 s with 2 threads beside one busy
# process, 3.4 s with 1; a short compression benchmark 190 s against 33 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# a model and corpus small enough that 4 workers train a few rounds in well under a minute
TINY = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "model.block_size=32",
    "inner.batch_size=8",
    "inner.warmup_steps=5",
    "inner.lr=3e-3",
    "data.max_bytes=400000",
    "logging.eval_batches=4",
    "logging.log_every=5",
    "comm.hivemind.matchmaking_s=20",
    # comm.hivemind.request_timeout_s stays at its default, 3 s: at 2 s, 3 of 14 four-worker runs beside a busy
    # core had a round not averaged by all four (once a follower that gave up on a leader that then
    # counted it in its group: 68 s lost; twice a part of the results lost), 0 of 14 at 3 s
    # a round's bound: about once in 20 multi-worker runs hivemind's matchmaking puts a peer in a
    # leader's group that it never joins, or one peer's all-reduce stalls (its parts stop coming), and
    # the round waits out its bounds (68-90 s at 90 s, 40-48 s at 40 s; the tests' rounds otherwise
    # take a second or two, the first one waiting up to matchmaking_s for every worker's start)
    "comm.deadline_s=30",
    "worker.threads=1",
]


@pytest.fixture
def cli_signal_handlers():
    """For a test that calls ``diloco.cli.main`` in this process: ``main`` installs the command
    line's SIGINT and SIGTERM handlers; pytest gets its own back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture
def diloco_cli(tmp_path_factory):
    """Run ``python -m diloco.cli ARGS`` in its own session (forked from the warm server, as the
    launcher starts its workers, when it can); kill the whole session afterwards."""
    started = []
    logs = tmp_path_factory.mktemp("diloco-cli")

    def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "diloco.cli", *args]
        log = logs / f"{len(started)}.log"
        if warm_start.starts_warm(command):
            process = warm_start.start(command, log)
        else:
            with log.open("wb") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(process)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            pytest.fail(f"diloco {' '.join(args)} did not finish in {timeout} s:\n{log.read_text()[-3000:]}")
        return subprocess.CompletedProcess(command, process.returncode, log.read_text(), "")

    yield run
    for process in started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


def read_records(run_dir: Path, worker: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"worker-{worker}.jsonl").read_text().splitlines()]


def round_records(run_dir: Path, worker: int) -> list[dict]:
    """Worker ``worker``'s round records, in order."""
    return [r for r in read_records(run_dir, worker) if r["event"] == "round"]


def log_tails(run_dir: Path, workers: int, lines: int = 30) -> str:
    """The last warnings and records of each worker's log, for an assertion's message: what a failed
    run did, where CI shows nothing else."""
    tails = []
    for worker in range(workers):
        log = run_dir / f"worker-{worker}.log"
        text = log.read_text() if log.exists() else ""
        kept = [line for line in text.splitlines() if " WARN " in line or "round " in line]
        tails.append(f"--- worker {worker}\n" + "\n".join(kept[-lines:]))
    return "\n".join(tails)
