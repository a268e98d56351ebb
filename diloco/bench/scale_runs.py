"""The training runs of ``diloco bench scale`` (``scale.py``): 2 workers of one model size on loopback.

- ``run_training``: ``diloco local``'s launcher, in this process, runs them to the end; the round
  records' costs (``scale_report.round_costs``), each worker's start-up, and the memory of this
  process's whole tree (the launcher, its fork server, the workers, their averagers, DHT and
  p2pd processes), sampled by ``process_memory.PeakSampler``;
- ``run_join``: the same with a slot free, which a third worker takes with ``diloco join``;
- ``run_kill_restart``: the workers as ``diloco train`` commands, a checkpoint every round; once
  worker 1 has a checkpoint on disk it is killed with SIGKILL and started again with the same
  command: whether both end on identical params;
- ``refusal``: the line with which ``diloco local`` would refuse the size on this machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from diloco.bench.process_memory import PeakSampler
from diloco.bench.scale_report import round_costs
from diloco.lifetime import stop_all

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
WORKERS = 2
SIZES = {
    "baby": [],
    "10m": ["model.n_layer=6", "model.n_head=6", "model.n_embd=384", "model.block_size=128"],
    "85m": ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=128"],
    "300m": ["model.n_layer=24", "model.n_head=16", "model.n_embd=1024", "model.block_size=128"],
    "llama-150m": ["model.kind=hf", "model.hf_config=llama-150m", "model.block_size=128"],
}
NEEDS_TRANSFORMERS = {"llama-150m"}
# a pause after each step of the join and restart runs (faults.step_delay_s): a small model's run
# must outlive a joiner's start-up, and a restart
PACE_S = {"baby": 2.0, "10m": 1.0}
MEMORY_INTERVAL_S = 0.25  # how often the process tree's memory is sampled
RESTART_TIMEOUT_S = 3600.0  # the bound of the whole restart run (300m on 2 shared cores takes minutes)
FIRST_STEP = '"event": "step"'  # how a step record's line reads (json.dumps' separators)


def training_overrides(size: str, *, steps: int, sync_every: int, run_dir: Path, checkpoints: bool = True) -> list[str]:
    from diloco.bench.arms import default_data

    return [
        *SIZES[size],
        f"data.path={default_data(None)}",
        "inner.batch_size=2",
        f"inner.steps={steps}",
        f"outer.sync_every={sync_every}",
        "inner.warmup_steps=1",
        f"checkpoint.every_rounds={int(checkpoints)}",
        "checkpoint.max_share=0",  # every round's: what a checkpoint costs is measured
        "comm.deadline_s=900",
        "comm.hivemind.matchmaking_s=30",
        "logging.eval_batches=2",
        "logging.log_every=1",  # a step record from the first step on: the start-up's end
        "worker.threads=1",
        f"comm.run_id=scale_{size.replace('-', '_')}",
        f"run.dir={run_dir}",
        f"run.name=scale-{size}",
    ]


def refusal(size: str, out: Path, workers: int = WORKERS) -> str | None:
    """``refused: <the one line>`` when ``diloco local`` would refuse ``workers`` workers of ``size``
    on this machine before they train (their estimated memory is more than is available), or None."""
    import torch

    from diloco.config import ConfigError, load_config
    from diloco.data.corpus import load_corpus
    from diloco.worker.memory import check_model_fits

    overrides = training_overrides(size, steps=2, sync_every=1, run_dir=out / size)
    cfg = load_config(CONFIG, [*overrides, f"worker.count={workers}"])
    try:
        check_model_fits(
            cfg.model,
            vocab_size=load_corpus(cfg.data).vocab_size,
            device=torch.device("cpu"),
            workers_here=workers,
            batch_size=cfg.inner.batch_size,
            precision=cfg.worker.precision,
        )
    except ConfigError as error:
        return f"refused: {error}"
    return None


class FirstStepClock:
    """Seconds from launch to each worker's first step record, by a thread that polls the JSONL files."""

    def __init__(self, run_dir: Path, workers: int, poll_s: float = 0.25):
        self.paths = [run_dir / f"worker-{i}.jsonl" for i in range(workers)]
        self.seconds: list[float | None] = [None] * workers
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="bench-scale-first-step", daemon=True)

    def __enter__(self) -> FirstStepClock:
        self.launched = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.poll_s)

    def _poll(self) -> None:
        while None in self.seconds and not self._stop.wait(self.poll_s):
            for i, path in enumerate(self.paths):
                if self.seconds[i] is None and path.exists() and FIRST_STEP in path.read_text():
                    self.seconds[i] = time.monotonic() - self.launched


@contextlib.contextmanager
def stdout_to(path: Path):
    """File descriptor 1 into ``path`` for the block: the launcher's progress lines write to the
    ``sys.stdout`` it held when imported, which ``contextlib.redirect_stdout`` does not reach."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(path, "w") as log:
            os.dup2(log.fileno(), 1)
            try:
                yield
            finally:
                sys.stdout.flush()
                os.dup2(saved, 1)
    finally:
        os.close(saved)


def _fresh(run_dir: Path) -> Path:
    shutil.rmtree(run_dir, ignore_errors=True)  # workers append to their records
    run_dir.mkdir(parents=True)
    return run_dir


def run_training(
    size: str, *, steps: int, sync_every: int, out: Path, checkpoints: bool = True, data_plane: str = "hivemind"
) -> dict:
    """2 workers of ``size`` to the end, averaging through ``data_plane``; their round costs and the
    memory of this process's tree while they ran (``memory``), or why there are none."""
    from diloco.config import load_config
    from diloco.tools.launcher import run_local
    from diloco.worker.metrics import _read_records

    run_dir = out / (size if checkpoints else f"{size}-no-checkpoints")
    if data_plane != "hivemind":
        run_dir = run_dir.with_name(f"{run_dir.name}-{data_plane}-plane")
    _fresh(run_dir)
    overrides = [
        *training_overrides(size, steps=steps, sync_every=sync_every, run_dir=run_dir, checkpoints=checkpoints),
        f"comm.hivemind.data_plane={data_plane}",
    ]
    cfg = load_config(CONFIG, [*overrides, f"worker.count={WORKERS}"])
    sampler = PeakSampler(os.getpid(), interval_s=MEMORY_INTERVAL_S)  # this process is the launcher
    with stdout_to(run_dir / "launcher.log"), FirstStepClock(run_dir, WORKERS) as clock, sampler:
        code = run_local(cfg, str(CONFIG), overrides, workers=WORKERS)
    result = {"exit_code": code, "run_dir": str(run_dir), "startup_s": clock.seconds, "memory": sampler.figures()}
    if code != 0:
        return {**result, "error": f"training exited {code}; see {run_dir}/worker-*.log"}
    records = [_read_records(run_dir / f"worker-{i}.jsonl") for i in range(WORKERS)]
    return {**result, **round_costs(records)}


JOINED = re.compile(r"downloaded the state of a peer after round \d+: (\d+) bytes in ([0-9.]+) s")


def _start_joiner(run_dir: Path, timeout_s: float, result: dict) -> None:
    """Once worker 0 has ended its first round, ``diloco join --peers ADDR`` (no config file) into
    ``run_dir``'s run, to its end; the seconds from its launch to its first step record in ``result``."""
    from diloco.lifetime import terminate_with_parent

    records, log = run_dir / "worker-0.jsonl", run_dir / "worker-0.log"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (records.exists() and '"event": "round"' in records.read_text()):
        time.sleep(0.5)  # polling files another process writes
    found = (
        re.search(r"join this run with: comm.hivemind.initial_peers=\['([^']+)'", log.read_text())
        if log.exists()
        else None
    )
    if found is None:
        result["error"] = "no round, or no address of worker 0, to join"
        return
    command = [
        sys.executable, "-m", "diloco.cli", "join", "--peers", found.group(1),
        "comm.run_id=scale_join", f"run.dir={run_dir}", "worker.threads=1", "logging.log_every=1",
    ]  # fmt: skip
    with open(run_dir / "joiner.log", "w") as joiner_log, FirstStepClock(run_dir, WORKERS + 1) as clock:
        joiner = subprocess.Popen(
            command,
            stdout=joiner_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=terminate_with_parent if sys.platform == "linux" else None,
        )
        try:
            joiner.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            stop_all([joiner])
    result["join_startup_s"] = clock.seconds[WORKERS]


def run_join(size: str, *, steps: int, sync_every: int, out: Path, timeout_s: float = 600.0) -> dict:
    """2 workers of ``size`` with a slot free, which a third takes once worker 0 has ended its first
    round (``_start_joiner``): its state download (bytes, seconds, from its log) and its start-up;
    or why there are none."""
    from diloco.config import load_config
    from diloco.tools.launcher import run_local

    run_dir = _fresh(out / f"{size}-join")
    overrides = [
        *training_overrides(size, steps=steps, sync_every=sync_every, run_dir=run_dir, checkpoints=False),
        "worker.slots=3",
        "comm.run_id=scale_join",
        f"faults.step_delay_s={PACE_S.get(size, 0.0)}",
    ]
    cfg = load_config(CONFIG, [*overrides, f"worker.count={WORKERS}"])
    result: dict = {}
    joining = threading.Thread(
        target=_start_joiner, args=(run_dir, timeout_s, result), name="bench-scale-joiner", daemon=True
    )
    with stdout_to(run_dir / "launcher.log"):
        joining.start()
        code = run_local(cfg, str(CONFIG), overrides, workers=WORKERS)
    joining.join(timeout=timeout_s)
    downloaded = JOINED.search((run_dir / "joiner.log").read_text()) if (run_dir / "joiner.log").exists() else None
    if code != 0 or downloaded is None:
        return {"error": result.get("error") or f"no state download (exit {code}); see {run_dir}/joiner.log"}
    return {**result, "state_bytes": int(downloaded.group(1)), "download_s": float(downloaded.group(2))}


def restart_steps(steps: int, sync_every: int) -> int:
    """The restart run's inner steps: ``steps``, and 3 rounds at least (a checkpointed round before
    the kill, the round it cuts, one after)."""
    return max(steps, 3 * sync_every)


def run_kill_restart(
    size: str, *, steps: int, sync_every: int, out: Path, timeout_s: float = RESTART_TIMEOUT_S
) -> dict:
    """2 workers of ``size`` (``diloco train`` commands, a checkpoint every round); once worker 1 has
    a checkpoint on disk, SIGKILL to it and its processes, and the same command again. Whether
    both end on identical params (their end records' digests), how the restarted one resumed."""
    from diloco.bench.faults import Cluster, latest_step, written_records
    from diloco.worker.checkpoint import list_checkpoints

    run_dir, victim, total = _fresh(out / f"{size}-restart"), WORKERS - 1, restart_steps(steps, sync_every)
    settings = [
        *training_overrides(size, steps=total, sync_every=sync_every, run_dir=run_dir),
        f"worker.count={WORKERS}",
        f"comm.run_id=scale_restart_{size.replace('-', '_')}",
        f"faults.step_delay_s={PACE_S.get(size, 0.0)}",
    ]
    deadline = time.monotonic() + timeout_s
    with Cluster(settings, run_dir, slots=WORKERS) as cluster:
        for index in range(WORKERS):
            cluster.start(index)
        checkpointed = lambda: bool(list_checkpoints(run_dir / "checkpoints", victim))  # noqa: E731
        try:
            cluster.wait_for(victim, checkpointed, deadline - time.monotonic(), "write a checkpoint")
        except TimeoutError as error:
            return {"error": f"{error}; see {run_dir}/worker-{victim}.log"}
        killed_at = latest_step(run_dir, victim)
        cluster.signal(victim, signal.SIGKILL)  # kill -9 of the worker and everything below it
        cluster.processes[victim].wait(timeout=30)  # SIGKILL: at once
        cluster.start(victim)  # the same command again, as its user reruns it
        codes = cluster.wait_all(max(1.0, deadline - time.monotonic()))
    ends = [[r for r in written_records(run_dir, i) if r.get("event") == "end"][-1:] for i in range(WORKERS)]
    digests = [end[0]["param_sha256"] if end else None for end in ends]
    resumed = [r for r in written_records(run_dir, victim) if r.get("event") == "resume"]
    return {
        "run_dir": str(run_dir),
        "exit_codes": codes,
        "steps": total,
        "killed_at_step": killed_at,
        "resumed_from": resumed[-1].get("source") if resumed else None,
        "param_sha256": digests,
        "identical": None not in digests and len(set(digests)) == 1 and set(codes.values()) == {0},
    }
