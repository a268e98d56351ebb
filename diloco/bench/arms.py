"""What the training benchmarks share: an arm (workers, H, overrides), one run of it on the
in-process simulator (or, with the override ``comm.backend=hivemind``, over real hivemind peers on
loopback), and the driver that runs arms x seeds, saving results after every run.

Every arm uses the reference workload: tinyshakespeare (byte-level), model "baby", a
fixed global batch of 48 sequences split over the workers, AdamW lr 1e-3, warm-up 50, cosine to
1e-4, clipping 1.0, and the very same worker loop as a real run (``comm.backend=simulator``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from diloco.errors import UsageError

GLOBAL_BATCH = 48
SHAKESPEARE = Path(__file__).resolve().parents[2] / "data" / "tinyshakespeare.txt"  # shipped with the project
COMMON = [
    "inner.lr=1e-3",
    "inner.min_lr=1e-4",
    "inner.warmup_steps=50",
    "inner.grad_clip=1.0",
    "logging.eval_batches=32",
    "logging.eval_batch_size=12",
    "logging.eval_every=50",
    "logging.log_every=100",
    "checkpoint.every_rounds=0",
    "comm.backend=simulator",
]


@dataclass(frozen=True)
class Arm:
    name: str
    workers: int
    sync_every: int  # 0 = data-parallel
    extra: tuple[str, ...] = ()  # further overrides (outer optimizer, compression)

    @property
    def overrides(self) -> list[str]:
        return [f"inner.batch_size={GLOBAL_BATCH // self.workers}", f"outer.sync_every={self.sync_every}", *self.extra]


def add_arm_flags(parser, *, steps: int, out: str) -> None:
    """The flags of a benchmark of arms x seeds (each adds its own ``--arms``)."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every arm")
    parser.add_argument("--data", help="text file (default data/tinyshakespeare.txt)")
    parser.add_argument("--steps", type=int, default=steps, help=f"inner steps per worker (default {steps})")
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds (default 3)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--out", default=out, help="output folder")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    parser.add_argument("--device", default="auto", help="cpu / cuda / auto")


def default_data(data: str | None) -> str:
    """The text file to train on: the one given, else the project's data/tinyshakespeare.txt, else "" (embedded)."""
    return data if data is not None else (str(SHAKESPEARE) if SHAKESPEARE.exists() else "")


class Job(NamedTuple):
    """One arm and seed to run, in ``out/<arm>-seed<seed>``."""

    arm: Arm
    seed: int
    data_path: str
    steps: int
    out: Path
    device: str
    threads: int  # torch threads, unless the overrides set worker.threads
    overrides: list[str]  # the user's, applied last

    def words(self) -> list[str]:
        """The workload, the arm's settings, then the user's overrides, as KEY=VALUE words."""
        arm, seed = self.arm, self.seed
        return [
            *COMMON,
            *arm.overrides,
            f"inner.steps={self.steps}",
            f"seed={seed}",
            f"data.path={self.data_path}",
            f"run.dir={self.out / f'{arm.name}-seed{seed}'}",
            f"run.name={arm.name}",
            f"worker.device={self.device}",
            f"comm.run_id=q_{arm.name.replace('-', '_').replace('.', '_')}_{seed}",
            *self.overrides,
        ]

    def config(self):
        """The run's config (``words``)."""
        from diloco.config import load_config

        return load_config(None, self.words())


def _run_one(job: Job) -> dict:
    """One arm and seed, in its own process: returns the run's summary."""
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    cfg = job.config()
    arm, seed, run_dir = job.arm, job.seed, cfg.run_dir
    torch.set_num_threads(cfg.worker.threads or job.threads)  # worker.threads=N overrides the share of the cores
    started = time.perf_counter()
    summary = finished_summary(cfg)
    reused = summary is not None
    if summary is None:
        shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short starts again: its old records must not mix in
        summary = _train(job, cfg)
    return {
        "arm": arm.name,
        "seed": seed,
        "run_dir": str(run_dir),
        "seconds": time.perf_counter() - started,
        "reused": reused,
        "final_val_loss": summary["final_val_loss"],
        "bytes_sent": summary["bytes_sent"],
        "params_agree": summary["params_agree"],
        "workers": summary["workers"],
        # a worker's compute per inner step (the simulator's workers take turns on one process)
        "step_ms": 1000 * (summary.get("compute_s") or 0.0) / max(1, summary.get("inner_steps") or 1),
    }


def _train(job: Job, cfg) -> dict:
    """The arm's run to the end: simulated in this process, or (``comm.backend=hivemind`` among the
    overrides) as ``diloco local`` runs it, one process a worker over real hivemind peers on loopback."""
    from diloco.tools.launcher import run_local, simulate
    from diloco.tools.outcome import EXIT_PARAMS_DIFFER

    if cfg.comm.backend != "hivemind":
        return simulate(cfg, workers=job.arm.workers)
    # workers that ended on different params finished: the summary says so (params_agree)
    if run_local(cfg, None, job.words(), workers=job.arm.workers) not in (0, EXIT_PARAMS_DIFFER):
        raise RuntimeError(f"{job.arm.name} seed {job.seed}: a worker failed; see the logs in {cfg.run_dir}")
    return json.loads((cfg.run_dir / "summary.json").read_text())


def finished_summary(cfg) -> dict | None:
    """The summary of a finished run of exactly this config in its run directory (a benchmark rerun
    into the same ``--out`` reuses it instead of training again), else None. Only what the run
    computes is compared, not where its directory is or what it is called: one moved into another
    ``--out`` is reused there, and one made with an arm's overrides by hand is reused as that arm.
    Delete a run directory to rerun it after changing the code."""
    from diloco.config import ConfigError, load_config, to_dict

    summary_path, config_path = cfg.run_dir / "summary.json", cfg.run_dir / "config.yaml"
    if not (summary_path.exists() and config_path.exists()):
        return None
    try:
        saved = to_dict(load_config(config_path))
        summary = json.loads(summary_path.read_text())
    except (ConfigError, ValueError):
        return None
    wanted = to_dict(cfg)
    for config in (saved, wanted):  # what launchers set per worker: index, count, threads, address, peers
        config.pop("worker")
        config["comm"]["hivemind"].pop("host"), config["comm"]["hivemind"].pop("initial_peers")
        config["comm"].pop("run_id"), config["run"].pop("name"), config["run"].pop("dir")  # labels
    finished = summary.get("inner_steps") == cfg.inner.steps and summary.get("final_val_loss") is not None
    return summary if finished and saved == wanted else None


def _refuse_to_replace_a_finished_run(cfg) -> None:
    """A run directory that holds a finished run of another config is the user's result: say so
    rather than train over it (one cut short, without a summary, is started again)."""
    from diloco.errors import UsageError

    if (cfg.run_dir / "summary.json").exists() and finished_summary(cfg) is None:
        raise UsageError(
            f"{cfg.run_dir} holds a finished run of another config (or another --steps); "
            f"move it away, or choose another --out or --first-seed"
        )


def run_arms(
    title: str,
    arms: Sequence[Arm],
    *,
    data_path: str,
    steps: int,
    seeds: Sequence[int],
    out: Path,
    jobs: int,
    device: str,
    overrides: list[str],
    collect: Callable[[list[dict]], dict],
    first: Sequence[str] = (),
) -> tuple[dict, list[dict]]:
    """Run every arm for every seed (the arms named in ``first`` first, so a run cut short still
    answers them); ``results.json`` (``collect`` of the runs so far) is rewritten after each run.
    Returns the last results and the runs."""
    seeds = list(seeds)
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    todo = [Job(arm, seed, data_path, steps, out, device, threads, overrides) for seed in seeds for arm in arms]
    configs = [job.config() for job in todo]
    if jobs > 1 and any(cfg.comm.backend == "hivemind" for cfg in configs):
        raise UsageError("comm.backend=hivemind runs a process per worker: run one arm at a time (--jobs 1)")
    out.mkdir(parents=True, exist_ok=True)
    for cfg in configs:
        _refuse_to_replace_a_finished_run(cfg)
    todo.sort(key=lambda job: (job.arm.name not in first, job.seed))
    print(
        f"{title}: {len(arms)} arms x seeds {', '.join(map(str, seeds))}, {steps} inner steps, "
        f"global batch {GLOBAL_BATCH}, data {data_path or 'embedded corpus'}, device {device}, {jobs} at a time",
        flush=True,
    )
    config = {"steps": steps, "seeds": seeds, "global_batch": GLOBAL_BATCH, "data": data_path, "device": device}
    config["overrides"] = overrides
    runs: list[dict] = []
    results: dict = {}

    def record(run: dict) -> None:
        nonlocal results
        runs.append(run)
        took = "reused a finished run" if run.get("reused") else f"{run['seconds']:.0f} s"
        print(
            f"  [{len(runs)}/{len(todo)}] {run['arm']} seed {run['seed']}: val {run['final_val_loss']:.4f} ({took})",
            flush=True,
        )
        results = {**collect(runs), "config": config}
        (out / "results.json").write_text(json.dumps(results, indent=2))  # after every run: nothing lost

    if jobs > 1:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for run in pool.imap_unordered(_run_one, todo):
                record(run)
            # let the workers exit on their own: leaving the block terminates them, in the middle of
            # their clean-up, and their semaphores are then reported leaked at shutdown
            pool.close()
            pool.join()
    else:
        for job in todo:
            record(_run_one(job))
    return results, runs


def rows_by_arm(runs: list[dict]) -> dict[str, dict]:
    """The runs grouped by arm: seeds, final val losses and compute per inner step (in seed order),
    and bytes sent per worker."""
    by_arm: dict[str, dict] = {}
    for run in sorted(runs, key=lambda r: (r["arm"], r["seed"])):
        row = by_arm.setdefault(run["arm"], {"seeds": [], "final_val_loss": [], "step_ms": [], "bytes_sent": 0})
        row["seeds"].append(run["seed"])
        row["final_val_loss"].append(run["final_val_loss"])
        row["step_ms"].append(run.get("step_ms"))
        row["bytes_sent"] = run["bytes_sent"]
    return by_arm


def loss_ratio(row: dict, base: dict) -> float | None:
    """Mean over the seeds both rows ran of ``row``'s final val loss / ``base``'s."""
    pairs = [
        (loss, base["final_val_loss"][base["seeds"].index(seed)])
        for seed, loss in zip(row["seeds"], row["final_val_loss"])
        if seed in base["seeds"]
    ]
    return statistics.mean(a / b for a, b in pairs) if pairs else None


def plot_first_seed(runs: list[dict], path: Path, axes: tuple[str, ...]) -> None:
    """Validation loss of every arm's run of the lowest seed against ``axes``."""
    from diloco.tools.plot import load_curve, plot_curves

    first = min(r["seed"] for r in runs)
    curves = [load_curve(Path(r["run_dir"])) for r in runs if r["seed"] == first]
    for curve in curves:
        curve["name"] = curve["name"].removesuffix(f"-seed{first}")
    plot_curves(curves, path, axes=axes)
