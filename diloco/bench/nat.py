"""``diloco bench nat``: what workers behind NAT cost a run, side by side with an all-public one.

Runs in the network testbed (``diloco/tools/testbed.py``, root and iptables): 4 real workers (``--workers``),
each in its network namespace on a link shaped to ``--rate`` Mbit/s both ways, with 0, 1, 2 and then 3 of them
behind a home router of their own (masquerading NAT, nothing can dial in), all on the default
config, so each NAT'd worker finds out it cannot be dialled and joins as a client. With
``--helpers`` each count of NAT'd workers also runs with that many helpers (``diloco helper``), each
on a public link of its own (``--helper-rate``, default ``--rate``: a helper on a data-centre link
is faster than a home one; with it, every peer declares its rate, ``comm.bandwidth_mbps``, and the
parts each reduces follow it); a run whose workers are all behind NAT runs only with helpers.
Per arm: the median round time (rounds after the first, which also waits for the workers to
start), its ratio to the all-public arm's, the rounds every worker averaged over all of them,
compute utilization (compute / wall), the helpers' median bytes a round (in + out, from their
logs), and whether the workers end on identical params.

    diloco bench nat                                      # 0, 1, 2, 3 of 4 behind NAT at 20 Mbit/s (~5 min on 2 cores)
    diloco bench nat --nat 0,2 --rate 5                   # some arms, another rate
    diloco bench nat --workers 3 --nat 0,2                # 2 of 3 behind NAT against none
    diloco bench nat --workers 3 --nat 0,2,3 --helpers 0,1  # and with a helper; 3 of 3 with one only

Prints the table and writes ``results.json`` under ``--out``.
"""

from __future__ import annotations

import contextlib
import json
import re
import statistics
from pathlib import Path

from diloco.bench import numbers

SYNC_EVERY = 20
_HELPER_ROUND = re.compile(
    r"^round (\d+): reduced parts for \d+ workers \(([\d.]+) MB in, ([\d.]+) MB out", re.MULTILINE
)


def _overrides(steps: int, arm: str, run_dir: Path) -> list[str]:
    return [
        "model.n_layer=2",
        "model.n_embd=128",
        "model.n_head=4",
        "model.block_size=64",
        "data.max_bytes=400000",
        f"inner.steps={steps}",
        "inner.batch_size=8",
        f"outer.sync_every={SYNC_EVERY}",
        "logging.eval_batches=4",
        "logging.log_every=50",
        "checkpoint.every_rounds=0",
        "comm.deadline_s=60",
        "comm.hivemind.matchmaking_s=15",
        f"comm.run_id=nat_{arm.replace('-', '_')}",
        f"run.dir={run_dir}",
        f"run.name=nat-{arm}",
    ]


def arms_of(nat_counts: list[int], helper_counts: list[int], workers: int) -> list[tuple[int, int]]:
    """(workers behind NAT, helpers) for each arm: every pair, but none where every worker is behind
    NAT without a helper (such a run cannot average)."""
    return [(n, h) for n in nat_counts for h in helper_counts if n < workers or h > 0]


def _launch(
    cfg,
    overrides: list[str],
    run_dir: Path,
    *,
    workers: int,
    helpers: int,
    nat: list[int],
    rate: float,
    helper_rate: float | None,
) -> int:
    """The run of ``cfg`` launched in a fresh testbed, workers ``nat`` behind NAT, the helpers' links
    of ``helper_rate`` (default ``rate``), the launcher's output in ``run_dir``; its exit code."""
    from diloco.tools.launcher import run_local
    from diloco.tools.testbed import Testbed

    with (
        Testbed(workers + helpers, up_mbit=rate, down_mbit=rate, nat=nat) as testbed,
        open(run_dir / "launcher.log", "w") as log,
        contextlib.redirect_stdout(log),
    ):
        helper_mbit = rate if helper_rate is None else helper_rate
        for helper in range(workers, workers + helpers):
            testbed.set_rate(helper, up_mbit=helper_mbit, down_mbit=helper_mbit)
        # each peer declares its link's rate: hivemind sizes the parts each reduces by it
        declared = [f"comm.bandwidth_mbps={rate:g}"] if helper_rate is not None else []
        helper_declared = (f"comm.bandwidth_mbps={helper_rate:g}",) if helper_rate is not None else ()
        return run_local(
            cfg,
            None,
            [*overrides, *declared],
            workers=workers,
            helpers=helpers,
            helper_overrides=helper_declared,
            testbed=testbed,
        )


def run_arm(
    behind_nat: int,
    *,
    workers: int,
    helpers: int = 0,
    rate: float,
    helper_rate: float | None = None,
    steps: int,
    out: Path,
) -> dict:
    """One run of ``workers`` with the last ``behind_nat`` workers behind NAT and ``helpers``
    helpers beside them, on links of ``helper_rate`` (default ``rate``); the row of the table."""
    from diloco.config import load_config

    arm = f"{behind_nat}-of-{workers}" + (f"-h{helpers}" if helpers else "")
    run_dir = out / f"nat-{arm}"
    overrides = _overrides(steps, arm, run_dir)
    cfg = load_config(None, [*overrides, f"worker.count={workers}"])
    run_dir.mkdir(parents=True, exist_ok=True)
    nat = list(range(workers - behind_nat, workers))
    code = _launch(
        cfg, overrides, run_dir, workers=workers, helpers=helpers, nat=nat, rate=rate, helper_rate=helper_rate
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [
        [json.loads(line) for line in (run_dir / f"worker-{w}.jsonl").read_text().splitlines()] for w in range(workers)
    ]
    rounds = [[r for r in worker if r["event"] == "round"] for worker in records]
    later = [r["comm_s"] for worker in rounds for r in worker if r["round"] > 1]
    full = sum(all(r["ok"] and r["peers"] == workers for r in by_round) for by_round in zip(*rounds))
    return {
        "behind_nat": behind_nat,
        "helpers": helpers,
        "helper_mb_per_round": _helper_mb_per_round(run_dir, helpers),
        "exit_code": code,
        "median_round_s": statistics.median(later) if later else float("nan"),
        "rounds": min(len(worker) for worker in rounds),
        "rounds_averaged_by_all": full,
        "compute_utilization": summary["compute_utilization"],
        "params_agree": summary["params_agree"],
        "run_dir": str(run_dir),
    }


def _helper_mb_per_round(run_dir: Path, helpers: int) -> float | None:
    """The helpers' median MB a round (in + out, all of them together, over the rounds they
    reduced), from their logs; 0 when they reduced none."""
    if not helpers:
        return None
    per_round: dict[int, float] = {}
    for index in range(helpers):
        path = run_dir / f"helper-{index}.log"
        for round_number, mb_in, mb_out in _HELPER_ROUND.findall(path.read_text() if path.exists() else ""):
            per_round[int(round_number)] = per_round.get(int(round_number), 0.0) + float(mb_in) + float(mb_out)
    return statistics.median(per_round.values()) if per_round else 0.0


def format_table(rows: list[dict], rate: float, workers: int, *, helper_rate: float | None = None) -> str:
    base = next((r["median_round_s"] for r in rows if r["behind_nat"] == 0 and not r.get("helpers")), None)
    helpers_at = f", helpers at {helper_rate:g} Mbit/s" if helper_rate is not None else ""
    lines = [
        f"{workers} workers at {rate:g} Mbit/s{helpers_at}, H={SYNC_EVERY}, default config "
        "(NAT'd workers join as clients)",
        "",
        "| behind NAT | helpers | median round | / all public | rounds averaged by all | utilization "
        "| helpers' MB / round | params agree |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = f"{r['median_round_s'] / base:.2f}" if base else "-"
        helper_mb = "-" if r.get("helper_mb_per_round") is None else f"{r['helper_mb_per_round']:.2f}"
        lines.append(
            f"| {r['behind_nat']} of {workers} | {r.get('helpers', 0)} | {r['median_round_s']:.2f} s | {ratio} | "
            f"{r['rounds_averaged_by_all']} of {r['rounds']} | {r['compute_utilization']:.3f} | {helper_mb} | "
            f"{'yes' if r['params_agree'] else 'NO'} |"
        )
    return "\n".join(lines)


def run_nat_benchmark(
    *,
    arms: list[int],
    workers: int,
    rate: float,
    steps: int,
    out: Path,
    helpers: list[int] | None = None,
    helper_rate: float | None = None,
) -> int:
    from diloco.tools.testbed import testbed_unavailable

    if (reason := testbed_unavailable(nat=True)) is not None:
        print(f"bench nat: {reason}")
        return 2
    if workers < 2 or any(not 0 <= n <= workers for n in arms):
        print(f"bench nat: --nat counts workers behind NAT, 0 to --workers ({workers}, at least 2); got {arms}")
        return 2
    helpers = helpers or [0]
    if helper_rate is not None and helper_rate < 0:
        print(f"bench nat: --helper-rate={helper_rate:g} must be >= 0 Mbit/s (0 = unshaped)")
        return 2
    if any(h < 0 for h in helpers) or not arms_of(arms, helpers, workers):
        print(f"bench nat: --helpers counts helpers (0 or more) and leaves no arm to run: {helpers}")
        return 2
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for behind_nat, helping in arms_of(arms, helpers, workers):
        print(f"bench nat: {behind_nat} of {workers} workers behind NAT, {helping} helpers ...", flush=True)
        rows.append(
            run_arm(
                behind_nat, workers=workers, helpers=helping, rate=rate, helper_rate=helper_rate, steps=steps, out=out
            )
        )
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print(format_table(rows, rate, workers, helper_rate=helper_rate))
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


def add_arguments(parser) -> None:
    """``diloco bench nat``'s flags."""
    parser.add_argument("--nat", default="0,1,2,3", help="how many of the 4 workers are behind NAT, per arm")
    parser.add_argument("--workers", type=int, default=4, help="workers per arm (default 4)")
    parser.add_argument("--rate", type=float, default=20.0, help="each link's rate both ways, Mbit/s (default 20)")
    parser.add_argument("--helpers", default="0", help="helpers beside the workers, per arm: e.g. 0,1 (default 0)")
    parser.add_argument("--helper-rate", type=float, help="each helper's link rate both ways, Mbit/s (default --rate)")
    parser.add_argument("--steps", type=int, default=200, help="inner steps per worker (default 200)")
    parser.add_argument("--out", default="runs/bench-nat", help="output folder")


def main(args) -> int:
    return run_nat_benchmark(
        arms=numbers(args.nat, int, "--nat"),
        helpers=numbers(args.helpers, int, "--helpers"),
        helper_rate=args.helper_rate,
        workers=args.workers,
        rate=args.rate,
        steps=args.steps,
        out=Path(args.out),
    )
