"""``diloco bench scale``: what a round costs at real model sizes, 2 workers on loopback, side by
side with stock hivemind and torch.distributed gloo averaging the same payload, and what a worker
holds in memory.

Per size: ``diloco local``'s launcher runs 2 workers on ``configs/tiny.yaml`` with that model
(batch 2, ``--steps`` inner steps, a round every ``--sync-every``) without checkpoints, over the
gloo data plane, then with a checkpoint every round (``scale_runs.run_training``). From the
workers' round records (``scale_report.round_costs``), over the rounds after the first: the
median of the sync (``comm_s``), of a round, of each phase (training, averaging, hashing,
evaluating, checkpointing) and of the rest; a checkpointed round over one without; the start-up.
Memory, over P (the params' fp32 bytes): while a run goes, a thread samples the summed PSS of
this process's whole tree every 0.25 s (the launcher, its workers, their averagers, DHT and p2pd
processes: ``process_memory``; pages shared between them count once); a worker's share is (the
run's peak - the peak of the same run of the baby model, which this command runs once,
first) / 2 / P; and the largest worker's peak RSS / P. A third run has a slot free: a third
worker joins with ``diloco join --peers ADDR``: its state download, bytes and seconds, and its
start-up. With ``--kill-restart``, a run of ``diloco train`` workers with a checkpoint every round
(3 rounds at least): once worker 1 has a checkpoint on disk it is killed with SIGKILL and started
again with the same command; whether both workers end on identical params. Last, 2 processes
average the same payload ``--compare-rounds`` times through stock hivemind's
``DecentralizedAverager``, then through gloo ``all_reduce`` (``scale_payload``).

    diloco bench scale                                   # baby, 10m, 85m (minutes on 2 cores)
    diloco bench scale --sizes baby --steps 8            # the smallest: about a minute on 2 cores
    diloco bench scale --sizes 300m --kill-restart 300m  # 302.7M parameters, a worker killed and restarted
    diloco bench scale --sizes 10m,llama-150m            # llama-150m needs pip install -e .[hf]

Sizes: baby (tiny.yaml's model), 10m (6 x 384), 85m (12 x 768), 300m (24 x 1024), all but baby
context 128, and llama-150m (``model.kind=hf``). A size ``diloco local`` would refuse on this
machine (its workers' estimated memory is more than is available) is a row saying so. Prints the
tables and writes ``results.json`` under ``--out``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from diloco.bench.scale_payload import BASELINES, run_baseline
from diloco.bench.scale_report import format_table, pss_per_worker, row_finished
from diloco.bench.scale_runs import (
    NEEDS_TRANSFORMERS,
    SIZES,
    WORKERS,
    refusal,
    run_join,
    run_kill_restart,
    run_training,
)

REFERENCE_SIZE = "baby"  # the run whose tree memory every other size's is measured above


def size_error(sizes: list[str], kill_restart: list[str] = ()) -> str | None:
    """The one line that says why ``sizes`` (and ``kill_restart``, some of them) cannot run here, or None."""
    from diloco.optional_deps import is_installed

    for size in sizes:
        if size not in SIZES:
            return f"bench scale: unknown size {size!r}: {', '.join(SIZES)}"
        if size in NEEDS_TRANSFORMERS and not is_installed("transformers"):
            return f"bench scale: {size} needs transformers, which is not installed: pip install -e .[hf]"
    for size in kill_restart:
        if size not in sizes:
            return f"bench scale: --kill-restart {size}: not among --sizes {','.join(sizes)}; add it there"
    return None


def with_memory(run: dict, reference: dict | None) -> dict:
    """``run`` with its tree PSS per worker over P (``scale_report.pss_per_worker``) added."""
    return {**run, "pss_per_worker_per_param_byte": pss_per_worker(run, reference)}


def measure_size(
    size: str,
    *,
    steps: int,
    sync_every: int,
    compare_rounds: int,
    out: Path,
    kill_restart: bool,
    reference: dict | None,
) -> dict:
    """The row of ``size``: our training runs' round costs and memory (without checkpoints; with them
    under ``checkpointed``), the join, the kill and restart when asked, then both baselines on its
    payload."""
    say = lambda what: print(f"bench scale: {size}: {what} ...", flush=True)  # noqa: E731
    say(f"{WORKERS} workers, {steps} steps, a round every {sync_every}")
    row = {"size": size, **run_training(size, steps=steps, sync_every=sync_every, out=out, checkpoints=False)}
    if "error" in row:
        return row
    reference = reference or row  # the reference size is its own reference
    row = with_memory(row, reference)
    say("the same with the gloo data plane")
    row["plane"] = run_training(size, steps=steps, sync_every=sync_every, out=out, checkpoints=False, data_plane="gloo")
    say("the same with a checkpoint every round")
    row["checkpointed"] = with_memory(
        run_training(size, steps=steps, sync_every=sync_every, out=out), reference.get("checkpointed")
    )
    if "error" in row["checkpointed"]:
        return {**row, "error": row["checkpointed"]["error"]}
    if (refused := refusal(size, out, workers=WORKERS + 1)) is None:  # three at once on this machine
        say("a third worker joins mid-run")
        row["join"] = run_join(size, steps=steps, sync_every=sync_every, out=out)
    else:
        row["join"] = {"error": f"no third worker: {refused}"}
    if kill_restart:
        say("worker 1 killed with -9 after its first checkpoint, and restarted")
        row["restart"] = run_kill_restart(size, steps=steps, sync_every=sync_every, out=out)
    for kind in BASELINES:
        say(f"the same payload through {kind}")
        row[kind] = run_baseline(kind, values=row["param_count"], rounds=compare_rounds, out=out / size)
    return row


def measure_reference(*, steps: int, sync_every: int, out: Path) -> dict:
    """The reference size's runs without and with checkpoints: their tree memory, which every size's
    is measured above; their costs too."""
    print(f"bench scale: {REFERENCE_SIZE}: the reference runs of memory ...", flush=True)
    reference = run_training(REFERENCE_SIZE, steps=steps, sync_every=sync_every, out=out, checkpoints=False)
    reference["checkpointed"] = run_training(REFERENCE_SIZE, steps=steps, sync_every=sync_every, out=out)
    return {"size": REFERENCE_SIZE, **reference}


def run_scale_benchmark(
    *, sizes: list[str], steps: int, sync_every: int, compare_rounds: int, out: Path, kill_restart: list[str] = ()
) -> int:
    if (error := size_error(sizes, kill_restart)) is not None:
        print(error, file=sys.stderr)
        return 2
    if steps < 2 * sync_every or sync_every < 1 or compare_rounds < 2:
        print(
            f"bench scale: need 2 rounds at least to measure one after the first: --steps {steps} "
            f"--sync-every {sync_every} --compare-rounds {compare_rounds}",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    rows, reference = [], None
    refusals = {size: refusal(size, out) for size in sizes}  # what diloco local would refuse here
    if REFERENCE_SIZE not in sizes and None in refusals.values():
        reference = measure_reference(steps=steps, sync_every=sync_every, out=out)
    for size in sorted(sizes, key=lambda size: size != REFERENCE_SIZE):  # the reference first
        if refusals[size] is not None:
            print(f"bench scale: {size}: {refusals[size]}", flush=True)
            row = {"size": size, "error": refusals[size]}
        else:
            row = measure_size(
                size, steps=steps, sync_every=sync_every, compare_rounds=compare_rounds, out=out,
                kill_restart=size in kill_restart, reference=reference,
            )  # fmt: skip
            reference = reference or (row if "error" not in row else None)
        rows.append(row)
        (out / "results.json").write_text(json.dumps({"reference": reference, "rows": rows}, indent=2))
    print(format_table(rows, steps=steps, sync_every=sync_every, workers=WORKERS, reference=reference))
    return 0 if all(row_finished(row) for row in rows) else 1


def add_arguments(parser) -> None:
    """``diloco bench scale``'s flags."""
    parser.add_argument("--sizes", default="baby,10m,85m", help=f"some of {', '.join(SIZES)} (default baby,10m,85m)")
    parser.add_argument("--steps", type=int, default=8, help="inner steps per worker (default 8)")
    parser.add_argument("--sync-every", type=int, default=2, help="H (default 2)")
    parser.add_argument("--compare-rounds", type=int, default=3, help="rounds of each baseline, the first a warm-up")
    parser.add_argument(
        "--kill-restart", default="", help="sizes (some of --sizes) run once more with worker 1 killed and restarted"
    )
    parser.add_argument("--out", default="runs/bench-scale", help="output folder")


def main(args) -> int:
    return run_scale_benchmark(
        sizes=[size for size in args.sizes.split(",") if size],
        steps=args.steps,
        sync_every=args.sync_every,
        compare_rounds=args.compare_rounds,
        out=Path(args.out),
        kill_restart=[size for size in args.kill_restart.split(",") if size],
    )
