"""``diloco bench quality``: DiLoCo against data-parallel training at equal tokens.

The reference workload: tinyshakespeare (byte-level), model "baby", a fixed global batch
of 48 sequences and a fixed number of inner steps (2000), AdamW lr 1e-3, warm-up 50, cosine to
1e-4, clipping 1.0. Data-parallel training (DDP: 4 workers of batch 12 averaging gradients every
step) against DiLoCo with M workers of batch 48/M; the arms named ``-muon`` train with Muon as the
inner optimizer (``inner.optimizer=muon``), and are also compared with DDP under Muon. Every arm
runs on the in-process simulator (``comm.backend=simulator``), with the very same worker loop as a
real run, for each seed.

    diloco bench quality                              # everything, 3 seeds (hours on 2 CPU cores)
    diloco bench quality --arms ddp,m4-h20 --seeds 1  # a part
    diloco bench quality --arms ddp,ddp-muon,m4-h50-lr1.0-m0.8,m4-h50-muon   # Muon against AdamW
    diloco bench quality --device cuda --jobs 8       # on a GPU machine: 8 runs at a time

Prints a table (final val loss, ratio to DDP, bytes per worker, DDP bytes / these bytes) and
writes ``results.json``, ``quality.png`` (validation loss against tokens and against bytes) and
one run directory per arm and seed under ``--out``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from diloco.bench import seeds
from diloco.bench.arms import Arm, add_arm_flags, default_data, loss_ratio, plot_first_seed, rows_by_arm, run_arms

FEDAVG = ("outer.optimizer=sgd", "outer.lr=1.0", "outer.momentum=0.0")
LESS_MOMENTUM = ("outer.lr=1.0", "outer.momentum=0.8")  # the best outer optimizer measured (docs/benchmarks.md)
MUON, DDP_MUON = "inner.optimizer=muon", "ddp-muon"
ARMS = [
    Arm("ddp", 4, 0),
    Arm("m1-h50", 1, 50),
    Arm("m1-h50-lr0.4", 1, 50, ("outer.lr=0.4",)),
    Arm("m1-h50-lr1.0", 1, 50, ("outer.lr=1.0",)),
    Arm("m1-h50-lr1.0-m0.8", 1, 50, LESS_MOMENTUM),
    Arm("m2-h20", 2, 20),
    Arm("m2-h50", 2, 50),
    Arm("m4-h10", 4, 10),
    Arm("m4-h20", 4, 20),
    Arm("m4-h20-lr1.0", 4, 20, ("outer.lr=1.0",)),
    Arm("m4-h20-lr1.0-m0.8", 4, 20, LESS_MOMENTUM),
    Arm("m4-h50", 4, 50),
    Arm("m4-h200", 4, 200),
    Arm("m4-h50-fedavg", 4, 50, FEDAVG),
    Arm("m4-h50-lr0.5", 4, 50, ("outer.lr=0.5",)),
    Arm("m4-h50-lr1.0", 4, 50, ("outer.lr=1.0",)),
    Arm("m4-h50-lr1.0-m0.8", 4, 50, LESS_MOMENTUM),
    # Muon as the inner optimizer (core/muon.py), the outer step as the best measured for AdamW
    Arm(DDP_MUON, 4, 0, (MUON,)),
    Arm("m1-h50-muon", 1, 50, (*LESS_MOMENTUM, MUON)),
    Arm("m4-h20-muon", 4, 20, (*LESS_MOMENTUM, MUON)),
    Arm("m4-h50-muon", 4, 50, (*LESS_MOMENTUM, MUON)),
    # Muon's pseudo-gradients compressed: int4 with error feedback, and SparseLoCo (its defaults)
    Arm("m4-h50-muon-int4", 4, 50, (*LESS_MOMENTUM, MUON, "compression.name=int4")),
    Arm("m4-h50-muon-sparseloco", 4, 50, ("outer.optimizer=sparseloco", MUON)),
]
CORE_ARMS = ("ddp", "m4-h20", "m4-h50", "m4-h50-fedavg", "m1-h50")


def _table(results: dict) -> str:
    lines = [
        "| arm | M | H | final val loss | / DDP | / DDP with Muon | bytes per worker | DDP bytes / these "
        "| ms / inner step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm in ARMS:
        row = results["arms"].get(arm.name)
        if row is None:
            continue
        losses = row["final_val_loss"]
        spread = f" ± {statistics.stdev(losses):.3f}" if len(losses) > 1 else ""
        ratio = f"{row['ratio_to_ddp']:.3f}" if row.get("ratio_to_ddp") else "-"
        to_muon = f"{row['ratio_to_ddp_muon']:.3f}" if row.get("ratio_to_ddp_muon") else "-"
        saving = f"{row['traffic_saving']:,.0f} x" if row.get("traffic_saving") else "-"
        lines.append(
            f"| {arm.name} | {arm.workers} | {arm.sync_every or 'every step'} | "
            f"{statistics.mean(losses):.4f}{spread} | {ratio} | {to_muon} | {row['bytes_sent']:,.0f} | {saving} | "
            f"{_median_ms(row)} |"
        )
    return "\n".join(lines)


def _median_ms(row: dict) -> str:
    """The median over the seeds of a worker's compute per inner step ("-" for runs that did not say)."""
    times = [t for t in row.get("step_ms", []) if t]
    return f"{statistics.median(times):.1f}" if times else "-"


def _collect(runs: list[dict]) -> dict:
    by_arm = rows_by_arm(runs)
    ddp, ddp_muon = by_arm.get("ddp"), by_arm.get(DDP_MUON)
    for name, row in by_arm.items():
        if ddp and name != "ddp":
            row["ratio_to_ddp"] = loss_ratio(row, ddp)
            row["traffic_saving"] = ddp["bytes_sent"] / row["bytes_sent"] if row["bytes_sent"] else None
        if ddp_muon and name != DDP_MUON:
            row["ratio_to_ddp_muon"] = loss_ratio(row, ddp_muon)
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
    seeds: Sequence[int],
    arms: list[str] | None,
    out: Path,
    jobs: int,
    device: str,
    overrides: list[str],
) -> int:
    from diloco.errors import UsageError

    chosen = [a for a in ARMS if arms is None or a.name in arms]
    unknown = sorted(set(arms or []) - {a.name for a in ARMS})
    if unknown:
        raise UsageError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(a.name for a in ARMS)}")
    results, runs = run_arms(
        "quality",
        chosen,
        data_path=default_data(data),
        steps=steps,
        seeds=seeds,
        out=out,
        jobs=jobs,
        device=device,
        overrides=overrides,
        collect=_collect,
        first=CORE_ARMS,
    )
    plot_first_seed(runs, out / "quality.png", axes=("tokens", "bytes"))
    print(_table(results))
    if "nesterov_beats_fedavg_every_seed" in results:
        print(f"Nesterov (m4-h50) beats FedAvg on every seed: {results['nesterov_beats_fedavg_every_seed']}")
    print(f"wrote {out / 'results.json'} and {out / 'quality.png'}")
    return 0


def add_arguments(parser) -> None:
    """``diloco bench quality``'s flags."""
    add_arm_flags(parser, steps=2000, out="runs/bench-quality")
    parser.add_argument("--arms", help="comma-separated arm names (default: all)")


def main(args) -> int:
    return run_quality_benchmark(
        data=args.data,
        steps=args.steps,
        seeds=seeds(args),
        arms=args.arms.split(",") if args.arms else None,
        out=Path(args.out),
        jobs=args.jobs,
        device=args.device,
        overrides=args.overrides,
    )
