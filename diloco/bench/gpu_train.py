"""``diloco bench gpu-train``: the framework trained end to end on one GPU, as a user runs it.

Three runs of the same config (``configs/gpt-111m.yaml``: the built-in GPT at 111M parameters,
bf16, compiled, on the real corpus that ``diloco corpus`` builds), each a real ``diloco`` command:

- **run**: M workers (``diloco train`` processes, hivemind peers on loopback, the gloo data
  plane) sharing the GPU, a round every H inner steps, a checkpoint every round; one worker is
  killed (SIGKILL) in the middle of the second round and restarted at once with the same
  command: it resumes from its checkpoint and takes the run's state from a peer. Figures: the
  run's tokens/s, each phase's share of a round (training, averaging, hashing, evaluating,
  checkpointing; the first round, which compiles, left out), peak GPU and host memory per
  worker, whether every worker ends on the same params (their digest) and what the restarted
  worker's log says it did;
- **alone**: one worker at the run's global batch (M x the batch), its rounds an outer step of
  plain averaging (``outer.optimizer=sgd outer.lr=1 outer.momentum=0``: the params are the
  local ones, so this is plain AdamW training). A data-parallel step over M workers averages the
  gradients of M x batch sequences; on one GPU that is this worker's step, so this run is the
  data-parallel baseline at equal tokens and global batch, and the run's throughput reference;
- **diloco**: M simulated workers (``comm.backend=simulator``, one process, taking turns on the
  GPU) with Nesterov's outer step, as many inner steps as ``alone``: the quality figure is its
  final val loss over ``alone``'s.

    diloco bench gpu-train                        # the three on a GPU (alone and diloco: 3.5 min on an H200)
    diloco bench gpu-train --parts alone,diloco   # some of them
    diloco bench gpu-train --smoke                # a tiny model on the CPU: checks the code path (CI)

Each part writes its figures to ``OUT/gpu-train.json`` as soon as it ends, so a run stopped
part-way keeps what it measured; the last line printed is that JSON.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from diloco.bench import write_json
from diloco.bench.faults import Cluster, latest_step, written_records
from diloco.config import load_config
from diloco.errors import UsageError
from diloco.tools.launcher import gpu_share_override, threads_per_worker
from diloco.worker.checkpoint import list_checkpoints

PARTS = ("run", "alone", "diloco")


@dataclass(frozen=True)
class TrainPlan:
    """What the three runs train."""

    config: str = "configs/gpt-111m.yaml"
    overrides: tuple[str, ...] = ()
    workers: int = 4  # M
    batch: int = 16  # sequences per worker step
    sync_every: int = 100  # H
    run_steps: int = 300  # inner steps of the hivemind run (a worker is killed in its second round)
    quality_steps: int = 400  # inner steps of alone and diloco, each worker (26M tokens each at M=4)
    timeout_s: float = 600.0  # each part
    # run: a pause after each inner step, so that a tiny model's run outlives the kill mid-run
    run_step_delay_s: float = 0.0


SMOKE = TrainPlan(
    config="",
    overrides=(
        "worker.device=cpu",
        "worker.precision=bf16",
        "model.n_layer=2",
        "model.n_embd=64",
        "model.n_head=2",
        "model.block_size=64",
        "data.max_bytes=400000",
        "logging.log_every=5",
        "logging.eval_batches=2",
        "comm.hivemind.data_plane=gloo",
        "outer.global_device=model",
        "inner.warmup_steps=5",
    ),
    workers=2,
    batch=4,
    sync_every=10,
    run_steps=60,
    quality_steps=20,
    timeout_s=180.0,  # under the tests' own limit (240 s), so that the bench's bounds fire first
    run_step_delay_s=0.1,  # its 60 steps take a second or two on a fast CPU
)


def phase_shares(rounds: Sequence[dict]) -> dict[str, float]:
    """Each phase's share of the rounds' time (the first round, which compiles, left out when
    there are others), from the round records' ``phases_s``."""
    rounds = [r for r in rounds if r.get("phases_s")]
    counted = [r for r in rounds if r["round"] > 1] or rounds
    spent: dict[str, float] = {}
    for record in counted:
        for phase, seconds in record["phases_s"].items():
            spent[phase] = spent.get(phase, 0.0) + seconds
    total = sum(spent.values()) or 1.0
    return {phase: round(seconds / total, 4) for phase, seconds in sorted(spent.items(), key=lambda kv: -kv[1])}


def first_round_tokens_per_s(records: Sequence[dict], sync_every: int) -> float | None:
    """The median tokens/s of a worker's step records in its first round, less the first record
    (compiling is in it). The run loses a worker in its second round: its first is fault-free."""
    steps = []
    for record in (r for r in records if r.get("event") == "step"):
        if record["step"] > sync_every or (steps and record["step"] <= steps[-1]["step"]):
            break  # past the first round, or a restarted process's records (the file is appended to)
        steps.append(record)
    rates = [r["tokens_per_s"] for r in steps[1:]]
    return statistics.median(rates) if rates else None


def _end_figures(run_dir: Path, workers: int, sync_every: int) -> dict:
    """What the workers' end and round records say of a finished run."""
    ends, by_worker, steady = [], [], []
    for index in range(workers):
        records = written_records(run_dir, index)
        ends += [r for r in records if r.get("event") == "end"][-1:]
        by_worker.append([r for r in records if r.get("event") == "round"])
        steady.append(first_round_tokens_per_s(records, sync_every))
    rounds, first = [r for worker in by_worker for r in worker], by_worker[0] if by_worker else []
    hashes = {end["param_sha256"] for end in ends}
    return {
        "finished": len(ends),
        "val_loss": statistics.mean(end["val_loss"] for end in ends) if ends else None,
        "params_identical": len(ends) == workers and len(hashes) == 1,
        "param_sha256": sorted(hashes),
        "tokens_per_s": sum(steady) if None not in steady else None,  # of all workers, in the first round
        "phase_shares": phase_shares(rounds),
        "round_s_median": _median_round_s(rounds),
        "peak_gpu_gb": [round(end.get("peak_gpu_bytes", 0) / 1e9, 2) for end in ends],
        "peak_host_gb": [round(end.get("peak_rss_bytes", 0) / 1e9, 2) for end in ends],
        # the first worker's, round by round
        "val_losses": [(r["round"], r["val_loss"]) for r in first],
        "phases_by_round": [r.get("phases_s", {}) for r in first],
    }


def _median_round_s(rounds: Sequence[dict]) -> float | None:
    """The median seconds of the rounds after the first (which compiles), from their phases."""
    timed = [sum(r["phases_s"].values()) for r in rounds if r.get("phases_s") and r["round"] > 1]
    return statistics.median(timed) if timed else None


def _common(plan: TrainPlan, run_dir: Path, steps: int, run_id: str) -> list[str]:
    """The config file (if any) and the settings every part shares."""
    return [
        *([plan.config] if plan.config else []),
        *plan.overrides,
        f"inner.steps={steps}",
        f"outer.sync_every={plan.sync_every}",
        f"run.dir={run_dir}",
        f"comm.run_id={run_id}",
    ]


def _diloco(argv: list[str], log: Path, timeout_s: float) -> int:
    """Run one ``diloco`` command to its end (or its timeout), its output into ``log``."""
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "diloco.cli", *argv], stdout=out, stderr=subprocess.STDOUT)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)  # the launcher stops its workers in order
            try:
                return process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                return -9


def run_alone_or_simulated(plan: TrainPlan, out: Path, part: str) -> dict:
    """``alone`` (one worker at the global batch, plain averaging) or ``diloco`` (M simulated workers)."""
    run_dir = out / part
    workers = 1 if part == "alone" else plan.workers
    argv = ["local", *_common(plan, run_dir, plan.quality_steps, f"gpu_{part}"), "comm.backend=simulator"]
    argv += ["checkpoint.every_rounds=0"]  # a figure of quality: the hivemind run measures checkpoints
    argv += ["--workers", str(workers)]
    if part == "alone":
        argv += [f"inner.batch_size={plan.batch * plan.workers}", "outer.optimizer=sgd", "outer.lr=1.0"]
        argv += ["outer.momentum=0.0"]
    else:
        argv += [f"inner.batch_size={plan.batch}"]
    started = time.monotonic()
    code = _diloco(argv, out / f"{part}.log", plan.timeout_s)
    figures = {"exit_code": code, "wall_s": round(time.monotonic() - started, 1)}
    figures.update(_end_figures(run_dir, workers, plan.sync_every))
    figures["tokens"] = plan.quality_steps * plan.batch * plan.workers * _context(run_dir)
    if workers > 1:  # simulated workers take turns: each one's rate is its own, not the run's
        figures["tokens_per_s"] = None
    return figures


def _context(run_dir: Path) -> int:
    """The run's sequence length, from the config every run directory keeps (0 if it never started)."""
    config = run_dir / "config.yaml"
    return load_config(str(config), []).model.block_size if config.exists() else 0


def kill_step(plan: TrainPlan) -> int:
    """The inner step in the middle of the second round, at which the run loses a worker."""
    return plan.sync_every + plan.sync_every // 2


def run_with_a_restart(plan: TrainPlan, out: Path) -> dict:
    """M hivemind workers; the last is killed mid-round 2 and restarted with the same command."""
    run_dir, victim = out / "run", plan.workers - 1
    settings = [
        *_common(plan, run_dir, plan.run_steps, "gpu_run"),
        f"worker.count={plan.workers}",
        f"inner.batch_size={plan.batch}",
        "checkpoint.every_rounds=1",
        gpu_share_override(plan.workers),  # as diloco local sets it (it applies on a GPU only)
        *([f"faults.step_delay_s={plan.run_step_delay_s}"] if plan.run_step_delay_s else []),
    ]
    threads = threads_per_worker(plan.workers)
    started = time.monotonic()

    def left_s() -> float:  # one deadline for the whole part
        return max(1.0, plan.timeout_s - (time.monotonic() - started))

    with Cluster(settings, run_dir, slots=plan.workers) as cluster:
        for index in range(plan.workers):
            cluster.start(index, threads=threads)
        cluster.wait_for_step(victim, kill_step(plan), left_s())
        # a checkpoint on disk (written in the background), so that it resumes from it; which round's
        # is not fixed (a worker that starts behind its peer takes its state and skips a round)
        checkpoints = run_dir / "checkpoints"
        cluster.wait_for(victim, lambda: bool(list_checkpoints(checkpoints, victim)), left_s(), "write a checkpoint")
        killed_at = latest_step(run_dir, victim)
        cluster.signal(victim, signal.SIGKILL)
        cluster.processes[victim].wait(timeout=30)  # SIGKILL: at once
        cluster.start(victim, threads=threads)
        codes = cluster.wait_all(left_s())
    figures = {"exit_codes": codes, "wall_s": round(time.monotonic() - started, 1), "killed_at_step": killed_at}
    figures.update(_end_figures(run_dir, plan.workers, plan.sync_every))
    log = (run_dir / f"worker-{victim}.log").read_text(errors="replace")
    figures["restarted_worker"] = {
        "resumed_from_checkpoint": "resumed at step" in log,
        "took_state_from_a_peer": "took the state" in log,
    }
    figures["tokens"] = plan.run_steps * plan.batch * plan.workers * _context(run_dir)
    return figures


def _conclude(results: dict) -> None:
    """The ratios measured side by side: the run's throughput over alone's, diloco's loss over alone's."""
    run, alone, diloco = (results.get(part) or {} for part in PARTS)
    if run.get("tokens_per_s") and alone.get("tokens_per_s"):
        results["run_over_alone_tokens_per_s"] = round(run["tokens_per_s"] / alone["tokens_per_s"], 4)
    if diloco.get("val_loss") and alone.get("val_loss"):
        results["diloco_over_data_parallel_val_loss"] = round(diloco["val_loss"] / alone["val_loss"], 4)


def _print_part(part: str, figures: dict) -> None:
    keys = ("exit_code", "exit_codes", "wall_s", "tokens", "tokens_per_s", "val_loss", "params_identical")
    keys += ("phase_shares", "peak_gpu_gb", "peak_host_gb", "restarted_worker")
    print(f"{part}: " + ", ".join(f"{key} {figures[key]}" for key in keys if key in figures), flush=True)


@dataclass
class Results:
    """Where the figures go, written after every part. Parts run before into the same folder with
    the same plan are kept (a GPU's time may come in several sittings), so the ratios can use them."""

    out: Path
    plan: TrainPlan
    figures: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            earlier = json.loads((self.out / "gpu-train.json").read_text())
        except (OSError, ValueError):
            return
        if earlier.get("plan") == json.loads(json.dumps(asdict(self.plan))):
            self.figures = {key: value for key, value in earlier.items() if key not in ("bench", "plan")}

    def write(self) -> str:
        return write_json(
            self.out / "gpu-train.json", {"bench": "gpu-train", "plan": asdict(self.plan), **self.figures}
        )


def run_gpu_train(plan: TrainPlan, out: Path, parts: Sequence[str] = PARTS) -> int:
    """Run ``parts`` in order, print each one's figures and, last, the JSON of all of them."""
    out.mkdir(parents=True, exist_ok=True)
    results = Results(out, plan)
    for part in parts:
        print(f"gpu-train: {part} ...", flush=True)
        try:
            figures = run_with_a_restart(plan, out) if part == "run" else run_alone_or_simulated(plan, out, part)
        except Exception as error:  # one part's failure must not cost the others' figures
            figures = {"error": f"{type(error).__name__}: {str(error).strip()[:300]}"}
        results.figures[part] = figures
        _print_part(part, figures)
        _conclude(results.figures)
        results.write()
    print(results.write())
    failed = [part for part in parts if "error" in results.figures[part]]
    return 1 if failed else 0


def add_arguments(parser) -> None:
    """``diloco bench gpu-train``'s flags."""
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the code path")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, among {', '.join(PARTS)}")
    parser.add_argument("--config", help="the runs' config file (default configs/gpt-111m.yaml)")
    parser.add_argument("--workers", type=int, help="M (default 4)")
    parser.add_argument("--sync-every", type=int, help="H, inner steps per round (default 100)")
    parser.add_argument("--run-steps", type=int, help="inner steps of the hivemind run (default 300)")
    parser.add_argument("--quality-steps", type=int, help="inner steps of alone and diloco (default 400)")
    parser.add_argument("--timeout-s", type=float, help="each part's limit (default 600)")
    parser.add_argument("--out", default="runs/bench-gpu-train", help="output folder (gpu-train.json, logs, runs)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE settings for every run")


def main(args: argparse.Namespace) -> int:
    """``diloco bench gpu-train``."""
    parts = tuple(args.parts.split(","))
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        raise UsageError(f"--parts: {', '.join(unknown)} not among {', '.join(PARTS)}")
    plan = SMOKE if args.smoke else TrainPlan()
    chosen = {
        "config": args.config,
        "workers": args.workers,
        "sync_every": args.sync_every,
        "run_steps": args.run_steps,
        "quality_steps": args.quality_steps,
        "timeout_s": args.timeout_s,
    }
    plan = replace(plan, **{key: value for key, value in chosen.items() if value is not None})
    plan = replace(plan, overrides=(*plan.overrides, *args.overrides))
    if plan.workers < 2 or plan.sync_every < 1 or plan.quality_steps < 1:
        raise UsageError(f"--workers {plan.workers} --sync-every {plan.sync_every}: need 2 workers or more, H >= 1")
    if plan.config and not Path(plan.config).is_file():
        raise UsageError(f"--config {plan.config}: no such file")
    if "run" in parts and plan.run_steps <= kill_step(plan):
        raise UsageError(
            f"--run-steps {plan.run_steps}: the run's worker is killed at step {kill_step(plan)} "
            f"(H={plan.sync_every} x 1.5); give it more steps than that"
        )
    return run_gpu_train(plan, Path(args.out), parts)
