"""``diloco bench compression``: each codec, and SparseLoCo, against dense DiLoCo on the quality workload.

M=4 workers, the reference budget (2000 inner steps, global batch 48), for each seed: at H=50
dense DiLoCo (Nesterov, lr 1.0, momentum 0.8) and the same with every lossy codec of
``compression.name`` (error feedback on); SparseLoCo (``outer.optimizer=sparseloco``: top-k
with decayed error feedback, Nesterov's step over the averaged sparse update) with its defaults
(184 of 4096 values, decay 0.85, momentum 0.5: those measured best here) and with the paper's
settings (``sparseloco-paper``: 64 of 4096, decay 0.95, a plain step); and dense and SparseLoCo
again at H=30 (with its defaults, and ``sparseloco-h30-k96``: 96 of 4096, about the bytes of the
defaults at H=50 over the budget). Each arm is compared with the dense arm of its H. Bytes are
those the simulator counts from the real payloads. DDP's bytes for the same budget (fp32
gradients every step, counted the same way) are computed, not run: ``steps x 2 (M-1)/M x payload``.

    diloco bench compression                                # every arm, 3 seeds
    diloco bench compression --steps 600 --seeds 1         # a quick look
    diloco bench compression --arms dense,sparseloco       # some arms

Prints final val loss / dense DiLoCo, bytes per worker, DDP bytes / these bytes and each
codec's encode+decode speed on a 10M-value pseudo-gradient (``--speed-values``) (MB/s of fp32 in, on this CPU), and
writes ``results.json`` and ``compression.png`` (validation loss against bytes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from diloco.bench import seeds
from diloco.bench.arms import (
    COMMON,
    Arm,
    add_arm_flags,
    default_data,
    loss_ratio,
    plot_first_seed,
    rows_by_arm,
    run_arms,
)
from diloco.compression import CODECS
from diloco.config.rules import SPARSELOCO_PAPER
from diloco.errors import UsageError

WORKERS = 4
DENSE_OUTER = ("outer.optimizer=nesterov", "outer.lr=1.0", "outer.momentum=0.8")  # dense DiLoCo's best measured
PAPER = "sparseloco-paper"  # SparseLoCo's settings in the paper (config/rules.py SPARSELOCO_PAPER)
H30_K = 96  # at H = 30, the density that sends about the default's bytes at H = 50 over the budget


@dataclass(frozen=True)
class CodecArm:
    """An arm of this benchmark: its run, the codec it sends with, and its targets (None: none)."""

    arm: Arm
    codec: str
    max_loss_ratio: float | None = None  # final val loss / the dense arm of the same H
    min_traffic_saving: float | None = None  # DDP bytes / this arm's


def _arms() -> list[CodecArm]:
    targets = {"int8": (1.005, None), "int4": (1.005, 400), "topk": (1.01, 5000)}
    arms = []
    for sync_every, suffix in ((50, ""), (30, "-h30")):
        codecs = CODECS if not suffix else ("none",)
        for name in codecs:
            arm_name = ("dense" if name == "none" else name) + suffix
            extra = (f"compression.name={name}", *DENSE_OUTER)
            arms.append(CodecArm(Arm(arm_name, WORKERS, sync_every, extra), name, *targets.get(name, (None, None))))
        sparse = Arm("sparseloco" + suffix, WORKERS, sync_every, ("outer.optimizer=sparseloco",))
        arms.append(CodecArm(sparse, "topk", 1.01, 2000))
        if suffix:
            extra = ("outer.optimizer=sparseloco", f"compression.topk_k={H30_K}")
            arms.append(CodecArm(Arm(f"sparseloco{suffix}-k{H30_K}", WORKERS, sync_every, extra), "topk", 1.01, 2000))
        else:
            paper = Arm(PAPER, WORKERS, sync_every, ("outer.optimizer=sparseloco", *SPARSELOCO_PAPER))
            arms.append(CodecArm(paper, "topk"))
    return arms


ARMS = _arms()


def dense_arm_of(arm: Arm) -> str:
    """The dense arm a run is compared with: dense DiLoCo at the same H."""
    return next(a.arm.name for a in ARMS if a.codec == "none" and a.arm.sync_every == arm.sync_every)


def codec_speed_mb_s(name: str, numel: int = 10_000_000, repeats: int = 3) -> float:
    """Median MB/s (fp32 in) of compress + decompress of ``numel`` random values."""
    import torch

    from diloco.compression import CompressionConfig, build_codec

    codec = build_codec(CompressionConfig(name=name))
    values = torch.randn(numel) * 1e-3
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        codec.decompress(codec.compress(values), numel)
        times.append(time.perf_counter() - started)
    return 4 * numel / 1e6 / statistics.median(times)


def ddp_bytes_per_worker(steps: int, overrides: list[str]) -> int:
    """What data-parallel training sends per worker for ``steps`` steps, as the simulator counts it."""
    from diloco.compression import NoCompression
    from diloco.config import load_config
    from diloco.models.gpt import build_model

    cfg = load_config(None, [*COMMON, *overrides])
    payload = sum(NoCompression().payload_bytes(p.numel()) for p in build_model(cfg.model).parameters())
    return steps * int(2 * (WORKERS - 1) / WORKERS * payload)


def _collector(ddp_bytes: int, speeds: dict[str, float]):
    def collect(runs: list[dict]) -> dict:
        by_arm = rows_by_arm(runs)
        for entry in ARMS:
            row, dense = by_arm.get(entry.arm.name), by_arm.get(dense_arm_of(entry.arm))
            if row is None:
                continue
            row["traffic_saving_vs_ddp"] = ddp_bytes / row["bytes_sent"] if row["bytes_sent"] else None
            if dense is not None and dense is not row:
                row["ratio_to_dense"] = loss_ratio(row, dense)
        return {"arms": by_arm, "runs": runs, "ddp_bytes_per_worker": ddp_bytes, "codec_mb_s": speeds}

    return collect


def _table(results: dict, speeds: dict[str, float]) -> str:
    lines = [
        "| arm | H | final val loss | / dense | bytes per worker | DDP bytes / these | codec MB/s | target |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in ARMS:
        row = results["arms"].get(entry.arm.name)
        if row is None:
            continue
        losses = row["final_val_loss"]
        spread = f" ± {statistics.stdev(losses):.3f}" if len(losses) > 1 else ""
        ratio = f"{row['ratio_to_dense']:.4f}" if row.get("ratio_to_dense") else "-"
        loss_target, traffic_target = entry.max_loss_ratio, entry.min_traffic_saving
        target = ", ".join(
            part
            for part in (
                f"<= {loss_target} x dense" if loss_target else "",
                f">= {traffic_target} x" if traffic_target else "",
            )
            if part
        )
        lines.append(
            f"| {entry.arm.name} | {entry.arm.sync_every} | {statistics.mean(losses):.4f}{spread} | {ratio} | "
            f"{row['bytes_sent']:,.0f} | {row['traffic_saving_vs_ddp']:,.0f} x | {speeds[entry.codec]:,.0f} | "
            f"{target or '-'} |"
        )
    return "\n".join(lines)


def run_compression_benchmark(
    *,
    data: str | None,
    steps: int,
    seeds: Sequence[int],
    out: Path,
    jobs: int,
    device: str,
    overrides: list[str],
    speed_values: int = 10_000_000,
    arm_names: Sequence[str] = (),
) -> int:
    chosen = select_arms(arm_names)
    speeds = {name: codec_speed_mb_s(name, speed_values) for name in sorted({a.codec for a in chosen})}
    ddp_bytes = ddp_bytes_per_worker(steps, overrides)
    results, runs = run_arms(
        "compression",
        [a.arm for a in chosen],
        data_path=default_data(data),
        steps=steps,
        seeds=seeds,
        out=out,
        jobs=jobs,
        device=device,
        overrides=overrides,
        collect=_collector(ddp_bytes, speeds),
        first=("dense", "dense-h30"),
    )
    plot_first_seed(runs, out / "compression.png", axes=("bytes",))
    print(_table(results, speeds))
    print(f"DDP would send {ddp_bytes:,} bytes per worker for the same {steps} steps")
    print(f"wrote {out / 'results.json'} and {out / 'compression.png'}")
    return 0


def select_arms(names: Sequence[str]) -> list[CodecArm]:
    """The arms named (all when none is), each with the dense arm it is compared with; raises
    ``UsageError`` naming an unknown one."""
    if not names:
        return list(ARMS)
    known = {a.arm.name for a in ARMS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise UsageError(f"--arms: {unknown[0]!r} is not one of {', '.join(a.arm.name for a in ARMS)}")
    wanted = set(names) | {dense_arm_of(a.arm) for a in ARMS if a.arm.name in names}
    return [a for a in ARMS if a.arm.name in wanted]


def add_arguments(parser) -> None:
    """``diloco bench compression``'s flags."""
    add_arm_flags(parser, steps=2000, out="runs/bench-compression")
    parser.add_argument("--arms", default="", help="comma-separated arms (default all; each brings its dense arm)")
    parser.add_argument(
        "--speed-values", type=int, default=10_000_000, help="values in the codec speed test (default 10M)"
    )


def main(args) -> int:
    return run_compression_benchmark(
        data=args.data,
        steps=args.steps,
        seeds=seeds(args),
        out=Path(args.out),
        jobs=args.jobs,
        device=args.device,
        overrides=args.overrides,
        speed_values=args.speed_values,
        arm_names=[name for name in args.arms.split(",") if name],
    )
