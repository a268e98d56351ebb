"""``diloco bench utilization``: how much compute each overlap strategy keeps on slow links.

Runs in the network testbed (``diloco/tools/testbed.py``, root only): real hivemind peers, one network
namespace each, links shaped with tbf to the same rate both ways.

1. Training: 4 workers, model "baby", H=50, on links of each ``--rates`` (Mbit/s), for each codec
   and each ``outer.overlap`` (none / streaming / delayed). Per run: compute_utilization
   (compute / wall), the bound min(1, compute per round / communication per round) where the
   communication is the bytes each worker sent over its link rate, the round time, the inner
   step time (does background communication slow compute?), the final val loss / blocking's at
   the same tokens, and peak and total bytes per worker.
2. All-reduce efficiency: a synthetic fp32 payload (``--payload-mb``) averaged by 2, 4 and 8
   peers at ``--allreduce-rate``: the lower bound 2 (n-1)/n x payload / rate over the measured
   round time (the last peer's arrival to the last peer's finish; the first round is a warm-up).

    diloco bench utilization                                   # everything (~1 hour on 2 cores)
    diloco bench utilization --parts allreduce --peers 2,4     # a part

Prints both tables and writes ``results.json`` and ``utilization.png`` under ``--out``.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from diloco.bench import numbers
from diloco.bench.arms import default_data, finished_summary
from diloco.lifetime import stop_all

WORKERS, SYNC_EVERY = 4, 50
PARTS = ("training", "allreduce")
OVERLAPS = {
    "none": [],
    "streaming": ["outer.overlap=streaming", "outer.fragments=5", "outer.delay_steps=5"],
    "delayed": ["outer.overlap=delayed"],
}


def _link_name(rate: float, drop_to: float | None) -> str:
    return f"{rate:g}" if drop_to is None else f"{rate:g}to{drop_to:g}"


def _training_overrides(
    data: str, steps: int, link: str, codec: str, overlap: str, run_dir: Path, adaptive: Sequence[str]
) -> list[str]:
    tag = f"{link}_{codec}_{overlap}".replace(".", "_")
    return [
        f"data.path={data}",
        f"inner.steps={steps}",
        "inner.batch_size=12",
        f"outer.sync_every={SYNC_EVERY}",
        f"compression.name={codec}",
        *OVERLAPS[overlap],
        "logging.eval_batches=8",
        "logging.log_every=50",
        "checkpoint.every_rounds=0",
        "comm.deadline_s=180",
        "comm.hivemind.matchmaking_s=30",
        f"comm.run_id=util_{tag}",
        f"run.dir={run_dir}",
        f"run.name={tag}",
        *(adaptive if codec == "adaptive" else ()),
    ]


def _drop_rate_after(testbed, records: Path, round_number: int, rate: float, stop: threading.Event) -> None:
    """Reshape every link to ``rate`` once worker 0 has recorded round ``round_number`` (a link that
    slows down mid-run: a volunteer's evening traffic, a shared uplink)."""
    while not stop.wait(0.5):
        found = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
        if any(r.get("event") == "round" and r["round"] >= round_number for r in found):
            for worker in range(WORKERS):
                testbed.set_rate(worker, up_mbit=rate, down_mbit=rate)
            print(f"  the links dropped to {rate:g} Mbit/s after round {round_number}", flush=True)
            return


def _codecs_used(run_dir: Path) -> list[str]:
    """The codec of each averaged round of worker 0 (compression.name=adaptive records it)."""
    path = run_dir / "worker-0.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["codec"] for r in records if r.get("event") == "round" and r.get("codec")]


def _train_in_testbed(
    cfg, overrides: list[str], run_dir: Path, *, rate: float, steps: int, drop_to: float | None
) -> int:
    """The run of ``cfg`` launched in a fresh testbed of ``rate`` Mbit/s links (slowed to ``drop_to``
    halfway through its rounds, if given), the launcher's output in ``run_dir``; its exit code."""
    from diloco.tools.launcher import run_local
    from diloco.tools.testbed import Testbed

    with (
        Testbed(WORKERS, up_mbit=rate, down_mbit=rate) as testbed,
        open(run_dir / "launcher.log", "w") as log,
        contextlib.redirect_stdout(log),
    ):
        stop = threading.Event()
        if drop_to is not None:
            records, halfway = run_dir / "worker-0.jsonl", max(1, steps // SYNC_EVERY // 2)
            args = (testbed, records, halfway, drop_to, stop)
            threading.Thread(target=_drop_rate_after, args=args, daemon=True).start()
        try:
            return run_local(cfg, None, overrides, workers=WORKERS, testbed=testbed)
        finally:
            stop.set()


def run_training(
    data: str,
    steps: int,
    rate: float,
    codec: str,
    overlap: str,
    out: Path,
    *,
    drop_to: float | None = None,
    adaptive: Sequence[str] = ("compression.comm_budget=0.25",),
) -> dict:
    """One 4-worker run in a fresh testbed; returns the row of the table. With ``drop_to`` the
    links slow from ``rate`` to it halfway through the run's rounds."""
    from diloco.config import load_config

    link = _link_name(rate, drop_to)
    run_dir = out / f"train-{link}mbit-{codec}-{overlap}"
    overrides = _training_overrides(data, steps, link, codec, overlap, run_dir, adaptive)
    cfg = load_config(None, [*overrides, f"worker.count={WORKERS}"])
    run_dir.mkdir(parents=True, exist_ok=True)
    summary, code = finished_summary(cfg), 0  # a rerun into the same --out reuses finished runs
    if summary is None:
        code = _train_in_testbed(cfg, overrides, run_dir, rate=rate, steps=steps, drop_to=drop_to)
        summary = json.loads((run_dir / "summary.json").read_text())
    rounds = max(1, summary["rounds"])
    compute_per_round = summary["compute_s"] / rounds
    slowest = rate if drop_to is None else min(rate, drop_to)  # the bound at the slower rate
    comm_per_round = summary["bytes_sent"] * 8 / (slowest * 1e6) / rounds
    return {
        "rate_mbit": rate,
        "drop_to_mbit": drop_to,
        "link": f"{rate:g} Mbit/s" if drop_to is None else f"{rate:g} -> {drop_to:g} Mbit/s",
        "codec": codec,
        "codecs_used": _codecs_used(run_dir),
        "overlap": overlap,
        "exit_code": code,
        "compute_utilization": summary["compute_utilization"],
        "bound": min(1.0, compute_per_round / comm_per_round) if comm_per_round else 1.0,
        "round_s": summary["wall_s"] / rounds,
        "inner_step_ms": 1000 * summary["compute_s"] / max(1, summary["inner_steps"]),
        "final_val_loss": summary["final_val_loss"],
        "params_agree": summary["params_agree"],
        "peak_sync_bytes": summary["peak_sync_bytes"],
        "bytes_sent": summary["bytes_sent"],
        "run_dir": str(run_dir),
    }


def run_allreduce(peers: int, rate: float, payload_mb: float, rounds: int, out: Path) -> dict:
    """``peers`` processes in a fresh testbed average ``payload_mb`` MB ``rounds`` times."""
    from diloco.tools.launcher import start_bootstrap
    from diloco.tools.testbed import Testbed

    log_dir = out / f"allreduce-{peers}peers"
    log_dir.mkdir(parents=True, exist_ok=True)
    with Testbed(peers, up_mbit=rate, down_mbit=rate) as testbed:
        bootstrap, addresses = start_bootstrap(host=testbed.host, timeout_s=120, log=log_dir / "bootstrap.log")
        processes = []
        try:
            for i in range(peers):
                command = [
                    sys.executable, "-m", "diloco.bench.allreduce_peer", "--peers", addresses[0],
                    "--count", str(peers), "--host", testbed.address(i),
                    "--payload-mb", str(payload_mb), "--rounds", str(rounds),
                ]  # fmt: skip
                with open(log_dir / f"peer-{i}.log", "w") as stderr:
                    processes.append(
                        subprocess.Popen(testbed.command(i, command), stdout=subprocess.PIPE, stderr=stderr, text=True)
                    )
            timeout_s = 120 + rounds * 4 * payload_mb * 8 / rate
            reports = [json.loads(p.communicate(timeout=timeout_s)[0].strip().splitlines()[-1]) for p in processes]
        finally:
            stop_all([*processes, bootstrap])
    measured = [
        max(r["ends"][k] for r in reports) - max(r["starts"][k] for r in reports)
        for k in range(1, rounds)  # round 0 includes start-up skew
    ]
    complete = all(min(r["peers"][1:]) == peers for r in reports)
    bound_s = 2 * (peers - 1) / peers * payload_mb * 1e6 * 8 / (rate * 1e6)
    round_s = statistics.median(measured)
    return {
        "peers": peers,
        "rate_mbit": rate,
        "payload_mb": payload_mb,
        "round_s": round_s,
        "rounds_s": measured,
        "bound_s": bound_s,
        "efficiency": bound_s / round_s,
        "every_round_complete": complete,
    }


def _training_table(rows: list[dict]) -> str:
    lines = [
        "| link | codec | overlap | utilization | bound | round s | inner step ms | val loss | / blocking "
        "| peak bytes per sync | bytes per worker |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ratio = f"{row['loss_ratio']:.4f}" if row.get("loss_ratio") else "-"
        lines.append(
            f"| {row['link']} | {row['codec']} | {row['overlap']} | {row['compute_utilization']:.3f} "
            f"| {row['bound']:.3f} | {row['round_s']:.1f} | {row['inner_step_ms']:.0f} | {row['final_val_loss']:.4f} "
            f"| {ratio} | {row['peak_sync_bytes']:,} | {row['bytes_sent']:,} |"
        )
    return "\n".join(lines)


def _allreduce_table(rows: list[dict]) -> str:
    lines = [
        "| peers | payload | link | bound s | measured s (median) | efficiency |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['peers']} | {row['payload_mb']:g} MB | {row['rate_mbit']:g} Mbit/s | {row['bound_s']:.1f} "
            f"| {row['round_s']:.1f} | {row['efficiency']:.3f} |"
        )
    return "\n".join(lines)


def _with_loss_ratios(rows: list[dict]) -> None:
    for row in rows:
        blocking = next(
            (r for r in rows if (r["link"], r["codec"], r["overlap"]) == (row["link"], row["codec"], "none")),
            None,
        )
        if blocking and row["overlap"] != "none":
            row["loss_ratio"] = row["final_val_loss"] / blocking["final_val_loss"]


def _plot(rows: list[dict], path: Path) -> None:
    from diloco.tools.plot import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['link'].replace(' Mbit/s', 'M')} {r['codec']}\n{r['overlap']}" for r in rows]
    ax.bar(range(len(rows)), [r["compute_utilization"] for r in rows], label="compute utilization")
    ax.scatter(range(len(rows)), [r["bound"] for r in rows], color="black", marker="_", s=400, label="bound")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("compute / wall")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _save(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))


def _training_part(
    data: str | None,
    steps: int,
    rates: list[float],
    drops: list[tuple[float, float]],
    codecs: list[str],
    overlaps: list[str],
    adaptive: list[str],
    out: Path,
    results: dict,
) -> None:
    """The training runs, one per link, codec and overlap, each row into ``results`` (saved after
    each); then the plot and the table."""
    from diloco.compression import ADAPTIVE

    data_path = default_data(data)
    print(f"training: {WORKERS} workers, H={SYNC_EVERY}, {steps} inner steps, data {data_path or 'embedded'}")
    links = [(rate, None) for rate in rates] + list(drops)
    for rate, drop_to in links:
        for codec in codecs:
            for overlap in overlaps:
                row = run_training(data_path, steps, rate, codec, overlap, out, drop_to=drop_to, adaptive=adaptive)
                results["training"].append(row)
                _with_loss_ratios(results["training"])
                _save(results, out)
                used = f", codecs {','.join(row['codecs_used'])}" if codec == ADAPTIVE else ""
                print(
                    f"  {row['link']} {codec} {overlap}: utilization {row['compute_utilization']:.3f} "
                    f"(bound {row['bound']:.3f}), val {row['final_val_loss']:.4f}{used}",
                    flush=True,
                )
    _plot(results["training"], out / "utilization.png")
    print(_training_table(results["training"]))
    for row in results["training"]:
        if row["codecs_used"]:
            used = ", ".join(row["codecs_used"])
            print(f"{row['link']} {row['codec']} {row['overlap']}: the rounds' codecs {used}")


def _allreduce_part(
    peers: list[int], allreduce_rate: float, payload_mb: float, rounds: int, out: Path, results: dict
) -> None:
    """The all-reduce runs, one per group size, each row into ``results`` (saved after each); then the table."""
    print(f"all-reduce: {payload_mb:g} MB fp32 at {allreduce_rate:g} Mbit/s, {rounds} rounds (first is warm-up)")
    for count in peers:
        row = run_allreduce(count, allreduce_rate, payload_mb, rounds, out)
        results["allreduce"].append(row)
        _save(results, out)
        print(f"  {count} peers: efficiency {row['efficiency']:.3f}", flush=True)
    print(_allreduce_table(results["allreduce"]))


def run_utilization_benchmark(
    *,
    data: str | None,
    steps: int,
    rates: list[float],
    drops: list[tuple[float, float]],
    codecs: list[str],
    comm_budget: float,
    adaptive_codecs: list[str],
    overlaps: list[str],
    peers: list[int],
    payload_mb: float,
    allreduce_rate: float,
    rounds: int,
    parts: list[str],
    out: Path,
) -> int:
    from diloco.errors import UsageError
    from diloco.tools.testbed import testbed_unavailable

    if (reason := testbed_unavailable()) is not None:
        raise UsageError(reason)
    from diloco.compression import ADAPTIVE, CODECS

    choices = (("overlap", overlaps, OVERLAPS), ("codec", codecs, (*CODECS, ADAPTIVE)), ("part", parts, PARTS))
    for kind, given, known in choices:
        if unknown := sorted(set(given) - set(known)):
            raise UsageError(f"unknown {kind}(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    every_rate = [*rates, *(r for drop in drops for r in drop)]
    if min(peers) < 2 or rounds < 2 or min(every_rate) <= 0 or allreduce_rate <= 0 or payload_mb <= 0 or steps < 1:
        raise UsageError(
            "need --peers >= 2, --rounds >= 2 (the first is a warm-up), rates and --payload-mb > 0, --steps >= 1"
        )
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"training": [], "allreduce": []}
    adaptive = [f"compression.comm_budget={comm_budget}"]  # the overrides of the adaptive runs
    if adaptive_codecs:
        adaptive.append(f"compression.adaptive_codecs=[{','.join(adaptive_codecs)}]")

    if "training" in parts:
        _training_part(data, steps, rates, drops, codecs, overlaps, adaptive, out, results)
    if "allreduce" in parts:
        _allreduce_part(peers, allreduce_rate, payload_mb, rounds, out, results)
    print(f"wrote {out / 'results.json'}" + (f" and {out / 'utilization.png'}" if "training" in parts else ""))
    return 0


def add_arguments(parser) -> None:
    """``diloco bench utilization``'s flags."""
    parser.add_argument("--data", help="text file (default data/tinyshakespeare.txt)")
    parser.add_argument("--steps", type=int, default=200, help="inner steps per training run (default 200)")
    parser.add_argument("--rates", default="20,5", help="link rates of the training runs, Mbit/s (default 20,5)")
    parser.add_argument(
        "--drops", default="", help="links that slow down halfway through a run, as FROM:TO Mbit/s (e.g. 20:5)"
    )
    parser.add_argument(
        "--codecs", default="none,int8", help="codecs of the training runs, adaptive included (default none,int8)"
    )
    parser.add_argument(
        "--comm-budget", type=float, default=0.25, help="compression.comm_budget of adaptive runs (default 0.25)"
    )
    parser.add_argument(
        "--adaptive-codecs", default="", help="compression.adaptive_codecs of adaptive runs (default: the config's)"
    )
    parser.add_argument("--overlaps", default="none,streaming,delayed", help="outer.overlap values")
    parser.add_argument("--peers", default="2,4,8", help="all-reduce group sizes (default 2,4,8)")
    parser.add_argument("--payload-mb", type=float, default=40.0, help="all-reduce payload, MB (default 40)")
    parser.add_argument("--allreduce-rate", type=float, default=20.0, help="all-reduce link rate, Mbit/s")
    parser.add_argument("--rounds", type=int, default=3, help="all-reduce rounds, the first a warm-up")
    parser.add_argument("--parts", default="training,allreduce", help="training, allreduce or both")
    parser.add_argument("--out", default="runs/bench-utilization", help="output folder")


def main(args) -> int:
    return run_utilization_benchmark(
        data=args.data,
        steps=args.steps,
        rates=numbers(args.rates, float, "--rates") if args.rates else [],
        drops=_drops(args.drops),
        codecs=args.codecs.split(","),
        comm_budget=args.comm_budget,
        adaptive_codecs=args.adaptive_codecs.split(",") if args.adaptive_codecs else [],
        overlaps=args.overlaps.split(","),
        peers=numbers(args.peers, int, "--peers"),
        payload_mb=args.payload_mb,
        allreduce_rate=args.allreduce_rate,
        rounds=args.rounds,
        parts=args.parts.split(","),
        out=Path(args.out),
    )


def _drops(text: str) -> list[tuple[float, float]]:
    """``--drops 20:5,50:10`` as [(20.0, 5.0), (50.0, 10.0)]; a one-line error for anything else."""
    from diloco.errors import UsageError

    drops = []
    for item in filter(None, text.split(",")):
        start, _, end = item.partition(":")
        try:
            drops.append((float(start), float(end)))
        except ValueError:
            raise UsageError(f"--drops {item!r}: give FROM:TO in Mbit/s, e.g. 20:5") from None
    return drops
