"""``diloco bench scale``: what a round costs at real model sizes, 2 workers on loopback, side by
side with stock hivemind and torch.distributed gloo averaging the same payload.

Per size: ``diloco local`` runs 2 workers on ``configs/tiny.yaml`` with that model (batch 2,
``--steps`` inner steps, a round every ``--sync-every``) twice: without checkpoints, then with a
checkpoint every round. From the workers' round records, over the rounds after the first (which
also waits for the start-up): the median of ``comm_s`` (our round sync, from the run without
checkpoints, so that no background write shares the cores with it), of a round's seconds, of
each phase of ``phases_s`` (checkpointing, evaluating, hashing, ...) and of the rest (a round's
seconds outside the named phases: matchmaking, downloading state, ...); a checkpointed round
over one without; the start-up (launch to a worker's first step record) and each worker's peak
resident memory over its parameters' fp32 bytes, with and without checkpoints. A third run
has a slot free: once worker 0 has ended its first round, a third worker joins with ``diloco
join --peers ADDR`` (no config file): the bytes and seconds of its state download, and its
start-up (launch to its first step record). Right after, 2 processes
(``diloco.bench.payload_peer``) average the same payload (param_count fp32 values)
``--compare-rounds`` times through stock ``hivemind.averaging.DecentralizedAverager``, then
through torch.distributed gloo ``all_reduce``: the median of the rounds after the first.

    diloco bench scale                                   # baby, 10m, 85m (minutes on 2 cores)
    diloco bench scale --sizes baby --steps 8            # the smallest: about a minute on 2 cores
    diloco bench scale --sizes 10m,llama-150m            # llama-150m needs pip install -e .[hf]

Sizes: baby (tiny.yaml's model), 10m (6 x 384), 85m (12 x 768), both context 128, and
llama-150m (``model.kind=hf``). Prints the table and writes ``results.json`` under ``--out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

from diloco.lifetime import stop_all

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
WORKERS = 2
SIZES = {
    "baby": [],
    "10m": ["model.n_layer=6", "model.n_head=6", "model.n_embd=384", "model.block_size=128"],
    "85m": ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=128"],
    "llama-150m": ["model.kind=hf", "model.hf_config=llama-150m", "model.block_size=128"],
}
NEEDS_TRANSFORMERS = {"llama-150m"}
# a pause after each step of the join run (faults.step_delay_s): a small model's run must outlive a joiner's start-up
JOIN_PACE_S = {"baby": 2.0, "10m": 1.0}
NAMED_PHASES = ("training", "averaging", "hashing", "evaluating", "checkpointing")
BASELINES = ("hivemind", "gloo")
FIRST_STEP = '"event": "step"'  # how a step record's line reads (json.dumps' separators)


def size_error(sizes: list[str]) -> str | None:
    """The one line that says why ``sizes`` cannot run here, or None."""
    from diloco.optional_deps import is_installed

    for size in sizes:
        if size not in SIZES:
            return f"bench scale: unknown size {size!r}: {', '.join(SIZES)}"
        if size in NEEDS_TRANSFORMERS and not is_installed("transformers"):
            return f"bench scale: {size} needs transformers, which is not installed: pip install -e .[hf]"
    return None


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
        "comm.deadline_s=900",
        "comm.hivemind.matchmaking_s=30",
        "logging.eval_batches=2",
        "logging.log_every=1",  # a step record from the first step on: the start-up's end
        "worker.threads=1",
        f"comm.run_id=scale_{size.replace('-', '_')}",
        f"run.dir={run_dir}",
        f"run.name=scale-{size}",
    ]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def round_costs(records: list[list[dict]]) -> dict:
    """Medians over every worker's rounds after the first: ``comm_s``, each phase, the rest; and
    each worker's peak RSS over its parameters' fp32 bytes. ``records``: each worker's records."""
    later = [r for worker in records for r in worker if r.get("event") == "round" and r["round"] > 1]
    spent = [r.get("phases_s", {}) for r in later]
    names = sorted({name for phases in spent for name in phases})
    phases = {name: _median([round_phases.get(name, 0.0) for round_phases in spent]) for name in names}
    rest = [sum(p.values()) - sum(p.get(name, 0.0) for name in NAMED_PHASES) for p in spent]
    ends = [next(r for r in reversed(worker) if r.get("event") == "end") for worker in records]
    param_count = ends[0]["param_count"]
    return {
        "param_count": param_count,
        "rounds_measured": len(later) // max(1, len(records)),
        "sync_s": _median([r["comm_s"] for r in later]),
        "round_s": _median([sum(p.values()) for p in spent]),
        "phases_s": phases,
        "rest_s": _median(rest),
        "rounds_ok": all(r["ok"] and r["peers"] == len(records) for r in later),
        "peak_rss_per_param_byte": [end["peak_rss_bytes"] / (4 * end["param_count"]) for end in ends],
        "wall_s": [end["wall_s"] for end in ends],
        "compute_s": [end["compute_s"] for end in ends],
    }


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


def run_training(
    size: str, *, steps: int, sync_every: int, out: Path, checkpoints: bool = True, data_plane: str = "hivemind"
) -> dict:
    """2 workers of ``size`` to the end, averaging through ``data_plane``; their round costs, or
    why there are none."""
    from diloco.config import load_config
    from diloco.tools.launcher import run_local
    from diloco.worker.metrics import _read_records

    run_dir = out / (size if checkpoints else f"{size}-no-checkpoints")
    if data_plane != "hivemind":
        run_dir = run_dir.with_name(f"{run_dir.name}-{data_plane}-plane")
    shutil.rmtree(run_dir, ignore_errors=True)  # workers append to their records
    run_dir.mkdir(parents=True)
    overrides = [
        *training_overrides(size, steps=steps, sync_every=sync_every, run_dir=run_dir, checkpoints=checkpoints),
        f"comm.hivemind.data_plane={data_plane}",
    ]
    cfg = load_config(CONFIG, [*overrides, f"worker.count={WORKERS}"])
    with stdout_to(run_dir / "launcher.log"), FirstStepClock(run_dir, WORKERS) as clock:
        code = run_local(cfg, str(CONFIG), overrides, workers=WORKERS)
    result = {"exit_code": code, "run_dir": str(run_dir), "startup_s": clock.seconds}
    if code != 0:
        return {**result, "error": f"training exited {code}; see {run_dir}/worker-*.log"}
    records = [_read_records(run_dir / f"worker-{i}.jsonl") for i in range(WORKERS)]
    return {**result, **round_costs(records)}


JOINED = re.compile(r"downloaded the state of a peer after round \d+: (\d+) bytes in ([0-9.]+) s")


def run_join(size: str, *, steps: int, sync_every: int, out: Path, timeout_s: float = 600.0) -> dict:
    """2 workers of ``size`` with a slot free; once worker 0 has ended its first round, a third
    joins with ``diloco join --peers ADDR`` (no config file). Its state download (bytes, seconds,
    from its log) and the seconds from its launch to its first step record; or why there are none."""
    from diloco.config import load_config
    from diloco.lifetime import terminate_with_parent
    from diloco.tools.launcher import run_local

    run_dir = out / f"{size}-join"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    overrides = [
        *training_overrides(size, steps=steps, sync_every=sync_every, run_dir=run_dir, checkpoints=False),
        "worker.slots=3",
        "comm.run_id=scale_join",
        f"faults.step_delay_s={JOIN_PACE_S.get(size, 0.0)}",
    ]
    cfg = load_config(CONFIG, [*overrides, f"worker.count={WORKERS}"])
    result: dict = {}

    def join_when_ready() -> None:
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
        with open(run_dir / "joiner.log", "w") as log, FirstStepClock(run_dir, WORKERS + 1) as clock:
            joiner = subprocess.Popen(
                command,
                stdout=log,
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

    joining = threading.Thread(target=join_when_ready, name="bench-scale-joiner", daemon=True)
    with stdout_to(run_dir / "launcher.log"):
        joining.start()
        code = run_local(cfg, str(CONFIG), overrides, workers=WORKERS)
    joining.join(timeout=timeout_s)
    downloaded = JOINED.search((run_dir / "joiner.log").read_text()) if (run_dir / "joiner.log").exists() else None
    if code != 0 or downloaded is None:
        return {"error": result.get("error") or f"no state download (exit {code}); see {run_dir}/joiner.log"}
    return {**result, "state_bytes": int(downloaded.group(1)), "download_s": float(downloaded.group(2))}


def payload_timeout_s(values: int) -> float:
    """The bound of each wait of a baseline peer: generous for 2 shared cores (2 s per MB)."""
    return 120.0 + 2.0 * values * 4 / 1e6


def _start_peer(kind: str, rank: int, *, values: int, rounds: int, rendezvous: Path, log: Path):
    from diloco.lifetime import die_with_parent

    command = [
        sys.executable, "-m", "diloco.bench.payload_peer", "--kind", kind, "--rank", str(rank),
        "--values", str(values), "--rounds", str(rounds), "--rendezvous", str(rendezvous),
        "--timeout-s", str(payload_timeout_s(values)),
    ]  # fmt: skip
    with open(log, "w") as stderr:
        return subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,  # its DHT and p2pd too: stop_all kills the whole session
            preexec_fn=partial(die_with_parent, signal.SIGTERM) if sys.platform == "linux" else None,
        )


def run_baseline(kind: str, *, values: int, rounds: int, out: Path) -> dict:
    """2 payload peers average ``values`` fp32 values ``rounds`` times through ``kind``; the median
    round (seconds, both peers, rounds after the first), or why there is none."""
    rendezvous = out / f"{kind}-rendezvous"
    shutil.rmtree(rendezvous, ignore_errors=True)
    rendezvous.mkdir(parents=True)
    bound_s = payload_timeout_s(values) * (rounds + 2)
    deadline = time.monotonic() + bound_s
    peers = []
    try:
        for rank in range(WORKERS):
            log = out / f"{kind}-peer-{rank}.log"
            peers.append(_start_peer(kind, rank, values=values, rounds=rounds, rendezvous=rendezvous, log=log))
        outputs = [peer.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for peer in peers]
    except subprocess.TimeoutExpired:
        return {"kind": kind, "error": f"no result within {bound_s:.0f} s; see {out}/{kind}-peer-*.log"}
    finally:
        stop_all(peers)
    reports = [json.loads(text.strip().splitlines()[-1]) for text in outputs if text.strip()]
    if len(reports) != WORKERS or not all(all(report["ok"]) for report in reports):
        return {"kind": kind, "error": f"a peer failed; see {out}/{kind}-peer-*.log", "reports": reports}
    return {
        "kind": kind,
        "median_s": statistics.median(s for report in reports for s in report["round_s"][1:]),
        "round_s": [report["round_s"] for report in reports],
    }


def measure_size(size: str, *, steps: int, sync_every: int, compare_rounds: int, out: Path) -> dict:
    """The row of ``size``: our training runs' round costs (without checkpoints; with them under
    ``checkpointed``), then both baselines on its payload."""
    print(f"bench scale: {size}: {WORKERS} workers, {steps} steps, a round every {sync_every} ...", flush=True)
    row = {"size": size, **run_training(size, steps=steps, sync_every=sync_every, out=out, checkpoints=False)}
    if "error" in row:
        return row
    print(f"bench scale: {size}: the same with the gloo data plane ...", flush=True)
    row["plane"] = run_training(size, steps=steps, sync_every=sync_every, out=out, checkpoints=False, data_plane="gloo")
    print(f"bench scale: {size}: the same with a checkpoint every round ...", flush=True)
    row["checkpointed"] = run_training(size, steps=steps, sync_every=sync_every, out=out)
    if "error" in row["checkpointed"]:
        return {**row, "error": row["checkpointed"]["error"]}
    print(f"bench scale: {size}: a third worker joins mid-run ...", flush=True)
    row["join"] = run_join(size, steps=steps, sync_every=sync_every, out=out)
    for kind in BASELINES:
        print(f"bench scale: {size}: the same payload through {kind} ...", flush=True)
        row[kind] = run_baseline(kind, values=row["param_count"], rounds=compare_rounds, out=out / size)
    return row


def row_finished(row: dict) -> bool:
    return "error" not in row and all("error" not in row[kind] for kind in BASELINES)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}" if ours is not None and theirs else "-"


def _download(join: dict) -> str:
    return f"{join['state_bytes'] / 1e6:.1f} MB in {join['download_s']:.2f} s" if "state_bytes" in join else "-"


def _rss(costs: dict) -> str:
    return f"{max(costs['peak_rss_per_param_byte']):.1f}" if "peak_rss_per_param_byte" in costs else "-"


def format_table(rows: list[dict], *, steps: int, sync_every: int) -> str:
    lines = [
        f"{WORKERS} workers on loopback, batch 2, {steps} inner steps, a round every {sync_every}; "
        "medians of the rounds after the first (seconds)",
        "",
        "| size | params (M) | fp32 MB | sync (ours) | sync (ours, gloo plane) | stock hivemind | gloo "
        "| ours/stock | ours/gloo | plane/stock | plane/gloo "
        "| round | checkpointed round / round | checkpoint | evaluation | hashing | rest "
        "| peak RSS / param bytes | the same, checkpointed | start-up | a joiner's state download | its start-up |",
        "|" + " --- |" * 22,
    ]
    for row in rows:
        if "param_count" not in row:
            lines.append(f"| {row['size']} | {row.get('error', 'no result')} |")
            continue
        params, phases, checkpointed = row["param_count"], row["phases_s"], row.get("checkpointed", {})
        ours, plane = row["sync_s"], row.get("plane", {}).get("sync_s")
        stock, gloo = (row.get(kind, {}).get("median_s") for kind in BASELINES)
        startup = [s for s in row["startup_s"] if s is not None]
        lines.append(
            f"| {row['size']} | {params / 1e6:.2f} | {params * 4 / 1e6:.1f} | {_seconds(ours)} | {_seconds(plane)} | "
            f"{_seconds(stock)} | {_seconds(gloo)} | {_ratio(ours, stock)} | {_ratio(ours, gloo)} | "
            f"{_ratio(plane, stock)} | {_ratio(plane, gloo)} | "
            f"{_seconds(row['round_s'])} | {_ratio(checkpointed.get('round_s'), row['round_s'])} | "
            f"{_seconds(checkpointed.get('phases_s', {}).get('checkpointing'))} | "
            f"{_seconds(phases.get('evaluating'))} | {_seconds(phases.get('hashing'))} | {_seconds(row['rest_s'])} | "
            f"{_rss(row)} | {_rss(checkpointed)} | {_seconds(max(startup, default=None))} | "
            f"{_download(row.get('join', {}))} | {_seconds(row.get('join', {}).get('join_startup_s'))} |"
        )
    failures = [
        f"{row['size']} {kind}: {row[kind]['error']}"
        for row in rows
        for kind in BASELINES
        if "error" in row.get(kind, {})
    ]
    return "\n".join([*lines, *failures])


def run_scale_benchmark(*, sizes: list[str], steps: int, sync_every: int, compare_rounds: int, out: Path) -> int:
    if (error := size_error(sizes)) is not None:
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
    rows = []
    for size in sizes:
        rows.append(measure_size(size, steps=steps, sync_every=sync_every, compare_rounds=compare_rounds, out=out))
        (out / "results.json").write_text(json.dumps(rows, indent=2))
    print(format_table(rows, steps=steps, sync_every=sync_every))
    return 0 if all(row_finished(row) for row in rows) else 1


def add_arguments(parser) -> None:
    """``diloco bench scale``'s flags."""
    parser.add_argument("--sizes", default="baby,10m,85m", help="baby, 10m, 85m, llama-150m (default baby,10m,85m)")
    parser.add_argument("--steps", type=int, default=8, help="inner steps per worker (default 8)")
    parser.add_argument("--sync-every", type=int, default=2, help="H (default 2)")
    parser.add_argument("--compare-rounds", type=int, default=3, help="rounds of each baseline, the first a warm-up")
    parser.add_argument("--out", default="runs/bench-scale", help="output folder")


def main(args) -> int:
    return run_scale_benchmark(
        sizes=[size for size in args.sizes.split(",") if size],
        steps=args.steps,
        sync_every=args.sync_every,
        compare_rounds=args.compare_rounds,
        out=Path(args.out),
    )
