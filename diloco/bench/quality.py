"""``diloco bench quality``: DiLoCo against data-parallel training at equal tokens.

The workload of BENCHMARKS.md: tinyshakespeare (byte-level), model "baby", a fixed global batch
of 48 sequences and a fixed number of inner steps (2000), AdamW lr 1e-3, warm-up 50, cosine to
1e-4, clipping 1.0. Data-parallel training (DDP: 4 workers of batch 12 averaging gradients every
step) against DiLoCo with M workers of batch 48/M. Every arm runs on the in-process simulator
(``comm.backend=inproc``), with the very same worker loop as a real run, for each seed.

    diloco bench quality                              # everything, 3 seeds (hours on 2 CPU cores)
    diloco bench quality --arms ddp,m4-h20 --seeds 1  # a part
    diloco bench quality --device cuda --jobs 8       # on a GPU machine: 8 runs at a time

Prints a table (final val loss, ratio to DDP, bytes per worker, DDP bytes / these bytes) and
writes ``results.json``, ``quality.png`` (validation loss against tokens and against bytes) and
one run directory per arm and seed under ``--out``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

GLOBAL_BATCH = 48
SHAKESPEARE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinyshakespeare.txt"


@dataclass(frozen=True)
class Arm:
    name: str
    workers: int
    sync_every: int  # 0 = data-parallel
    outer: tuple[str, ...] = ()  # outer-optimizer overrides

    @property
    def overrides(self) -> list[str]:
        return [f"inner.batch_size={GLOBAL_BATCH // self.workers}", f"outer.sync_every={self.sync_every}", *self.outer]


FEDAVG = ("outer.optimizer=sgd", "outer.lr=1.0", "outer.momentum=0.0")
ARMS = [
    Arm("ddp", 4, 0),
    Arm("m1-h50", 1, 50),
    Arm("m2-h20", 2, 20),
    Arm("m2-h50", 2, 50),
    Arm("m4-h10", 4, 10),
    Arm("m4-h20", 4, 20),
    Arm("m4-h50", 4, 50),
    Arm("m4-h200", 4, 200),
    Arm("m4-h50-fedavg", 4, 50, FEDAVG),
    Arm("m4-h50-lr0.5", 4, 50, ("outer.lr=0.5",)),
    Arm("m4-h50-lr1.0", 4, 50, ("outer.lr=1.0",)),
]
CORE_ARMS = ("ddp", "m4-h20", "m4-h50", "m4-h50-fedavg", "m1-h50")
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
    "comm.backend=inproc",
]


def _run_one(job: tuple) -> dict:
    """One arm and seed, in its own process: returns the run's summary."""
    arm, seed, data_path, steps, out, device, threads, overrides = job
    import logging

    import torch

    from diloco.config import load_config
    from diloco.local import simulate

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(threads)
    run_dir = out / f"{arm.name}-seed{seed}"
    cfg = load_config(
        None,
        [
            *COMMON,
            *arm.overrides,
            f"inner.steps={steps}",
            f"seed={seed}",
            f"data.path={data_path}",
            f"run.dir={run_dir}",
            f"run.name={arm.name}",
            f"worker.device={device}",
            f"comm.run_id=q_{arm.name.replace('-', '_').replace('.', '_')}_{seed}",
            *overrides,
        ],
    )
    started = time.perf_counter()
    summary = simulate(cfg, workers=arm.workers)
    return {
        "arm": arm.name,
        "seed": seed,
        "run_dir": str(run_dir),
        "seconds": time.perf_counter() - started,
        "final_val_loss": summary["final_val_loss"],
        "bytes_sent": summary["bytes_sent"],
        "params_agree": summary["params_agree"],
        "workers": summary["workers"],
    }


def _table(results: dict) -> str:
    lines = [
        "| arm | M | H | final val loss | / DDP | bytes per worker | DDP bytes / these |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm in ARMS:
        row = results["arms"].get(arm.name)
        if row is None:
            continue
        losses = row["final_val_loss"]
        spread = f" ± {statistics.stdev(losses):.3f}" if len(losses) > 1 else ""
        ratio = f"{row['ratio_to_ddp']:.3f}" if row.get("ratio_to_ddp") else "-"
        saving = f"{row['traffic_saving']:,.0f} x" if row.get("traffic_saving") else "-"
        lines.append(
            f"| {arm.name} | {arm.workers} | {arm.sync_every or 'every step'} | "
            f"{statistics.mean(losses):.4f}{spread} | {ratio} | {row['bytes_sent']:,.0f} | {saving} |"
        )
    return "\n".join(lines)


def _collect(runs: list[dict]) -> dict:
    by_arm: dict[str, dict] = {}
    for run in sorted(runs, key=lambda r: (r["arm"], r["seed"])):
        row = by_arm.setdefault(run["arm"], {"seeds": [], "final_val_loss": [], "bytes_sent": 0})
        row["seeds"].append(run["seed"])
        row["final_val_loss"].append(run["final_val_loss"])
        row["bytes_sent"] = run["bytes_sent"]
    ddp = by_arm.get("ddp")
    for name, row in by_arm.items():
        if ddp and name != "ddp":
            pairs = [
                (loss, ddp["final_val_loss"][ddp["seeds"].index(seed)])
                for seed, loss in zip(row["seeds"], row["final_val_loss"])
                if seed in ddp["seeds"]
            ]
            row["ratio_to_ddp"] = statistics.mean(a / b for a, b in pairs) if pairs else None
            row["traffic_saving"] = ddp["bytes_sent"] / row["bytes_sent"] if row["bytes_sent"] else None
    results = {"arms": by_arm, "runs": runs}
    nesterov, fedavg = by_arm.get("m4-h50"), by_arm.get("m4-h50-fedavg")
    if nesterov and fedavg:
        results["nesterov_beats_fedavg_every_seed"] = all(
            n < f for n, f in zip(nesterov["final_val_loss"], fedavg["final_val_loss"])
        )
    return results


def run_quality_benchmark(
    *,
    data: str | None,
    steps: int,
    seeds: int,
    arms: list[str] | None,
    out: Path,
    jobs: int,
    device: str,
    overrides: list[str],
) -> int:
    from diloco.cli import UsageError
    from diloco.plot import load_curve, plot_curves

    chosen = [a for a in ARMS if arms is None or a.name in arms]
    unknown = sorted(set(arms or []) - {a.name for a in ARMS})
    if unknown:
        raise UsageError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(a.name for a in ARMS)}")
    data_path = data if data is not None else (str(SHAKESPEARE) if SHAKESPEARE.exists() else "")
    out.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    # the arms the targets are about first, so that a run cut short still answers them
    todo = [(arm, seed, data_path, steps, out, device, threads, overrides) for seed in range(seeds) for arm in chosen]
    todo.sort(key=lambda job: (job[0].name not in CORE_ARMS, job[1]))
    print(
        f"quality: {len(chosen)} arms x {seeds} seeds, {steps} inner steps, global batch {GLOBAL_BATCH}, "
        f"data {data_path or 'embedded corpus'}, device {device}, {jobs} at a time",
        flush=True,
    )
    runs: list[dict] = []
    config = {
        "steps": steps,
        "seeds": seeds,
        "global_batch": GLOBAL_BATCH,
        "data": data_path,
        "device": device,
        "overrides": overrides,
    }

    def record(run: dict) -> dict:
        runs.append(run)
        print(
            f"  [{len(runs)}/{len(todo)}] {run['arm']} seed {run['seed']}: val {run['final_val_loss']:.4f} "
            f"({run['seconds']:.0f} s)",
            flush=True,
        )
        results = {**_collect(runs), "config": config}
        (out / "results.json").write_text(json.dumps(results, indent=2))  # after every run: nothing lost
        return results

    results = {}
    if jobs > 1:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for run in pool.imap_unordered(_run_one, todo):
                results = record(run)
    else:
        for job in todo:
            results = record(_run_one(job))
    curves = [load_curve(Path(r["run_dir"])) for r in runs if r["seed"] == 0]
    for curve in curves:
        curve["name"] = curve["name"].removesuffix("-seed0")
    plot_curves(curves, out / "quality.png", axes=("tokens", "bytes"))
    print(_table(results))
    if "nesterov_beats_fedavg_every_seed" in results:
        print(f"Nesterov (m4-h50) beats FedAvg on every seed: {results['nesterov_beats_fedavg_every_seed']}")
    print(f"wrote {out / 'results.json'} and {out / 'quality.png'}")
    return 0
