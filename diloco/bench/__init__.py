"""``diloco bench NAME``: each benchmark declares its own flags and runs from them.

A benchmark module has ``add_arguments(parser)`` and ``main(args) -> int``; ``BENCHMARKS`` names
each module with its one-line help, in the order ``diloco bench --help`` lists them. Only the
chosen benchmark's module is imported to parse its flags, so the command line stays quick.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from diloco.errors import UsageError

BENCHMARKS = {
    "overhead": ("diloco.bench.overhead", "inner-step throughput against a bare PyTorch loop"),
    "quality": ("diloco.bench.quality", "DiLoCo against data-parallel training at equal tokens"),
    "faults": ("diloco.bench.faults", "crash, cut link, slow link, join, bad and wrong-key peers, 4 workers"),
    "nat": ("diloco.bench.nat", "rounds and utilization with 0-3 of 4 workers behind NAT (testbed, root)"),
    "scale": ("diloco.bench.scale", "a round's cost at real model sizes against stock hivemind and gloo"),
    "utilization": (
        "diloco.bench.utilization",
        "compute utilization of each overlap strategy on shaped links, all-reduce efficiency (root)",
    ),
    "gpu": ("diloco.bench.gpu", "one GPU: inner-step tokens/s and MFU, the outer sync's local work"),
    "gpu-train": (
        "diloco.bench.gpu_train",
        "one GPU end to end: M workers over hivemind with a restart, one worker alone, DiLoCo against data-parallel",
    ),
    "compression": ("diloco.bench.compression", "each compression codec against dense DiLoCo (M=4, H=50)"),
    "attacks": ("diloco.bench.attacks", "one worker of four attacks the run: the screening's effect and cost"),
}


def add_benchmarks(subparsers, chosen: str | None) -> None:
    """A parser per benchmark; the ``chosen`` one (``diloco bench NAME ...``) with its flags."""
    for name, (module, help_text) in BENCHMARKS.items():
        parser = subparsers.add_parser(name, help=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(parser)


def run_benchmark(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHMARKS[args.bench][0]).main(args)


def numbers(text: str, kind: type, option: str) -> list:
    """A comma-separated list of numbers from the command line."""
    try:
        return [kind(word) for word in text.split(",")]
    except ValueError:
        raise UsageError(f"{option}={text!r} is not a comma-separated list of {kind.__name__} numbers") from None


def seeds(args: argparse.Namespace) -> range:
    """The seeds a training benchmark runs: ``--seeds`` of them from ``--first-seed``."""
    if args.seeds < 1 or args.first_seed < 0:
        raise UsageError(f"--seeds {args.seeds} --first-seed {args.first_seed}: need at least one seed, from 0 up")
    return range(args.first_seed, args.first_seed + args.seeds)


def write_json(path: Path, record: dict) -> str:
    """Replace ``path`` with ``record`` as one JSON line in one step (a reader sees the old file or
    the new one; a benchmark stopped part-way leaves what it had measured); the line."""
    line = json.dumps(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(line + "\n")
    partial.replace(path)
    return line
