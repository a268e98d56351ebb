"""``diloco bench attacks``: one worker of four attacks the run; the screening against it, measured.

The reference workload on the simulator (``arms.py``: tinyshakespeare, model "baby", M = 4, global
batch 48, H = 50, Nesterov lr 1.0 momentum 0.8), 600 inner steps. Worker 3 attacks with the
project's fault knobs; every arm but those named ``-off`` screens as a run others can reach does by
default (``comm.trust=open``: the sketches' verdicts and the clip to the median norm, with the norm
and weight bounds):

    clean          no attack
    sign-flip      worker 3 sends minus its pseudo-gradient (the same norm)
    minus-9x       minus 9 x it (inside comm.max_norm_ratio=10)
    9x             9 x it
    free-rider     zeros (it sends nothing of value and claims its samples)
    noise          Gaussian noise of its pseudo-gradient's norm, new each round
    replay         its pseudo-gradient of the round before, passed off as this round's
    weight-1000x   its real pseudo-gradient, claiming 1,000 x its samples as its weight
    clean-off, minus-9x-off   the same with every screen off: what the screening buys and costs
    without-3      worker 3 sends zeros, left out every round (their norm per sample, and
                   comm.min_cosine=0.1 too): the run of the three others on their quarters of the
                   data, the best a screening that leaves the attacker out can do (its quarter of
                   the data is lost with it); the same run as free-rider since zeros are dropped
    clean-8, sign-flip-2-of-8, minus-9x-2-of-8   M = 8 (the same global batch): workers 6 and 7
                   attack together, compared with clean-8

Per arm: the final val loss over the clean (screened) run's of the same seed, and over
``without-3``'s, and the rounds in which a contribution was left out (of worker 3, the attacker; of
any other worker in ``clean``, which must be none). ``clean`` over ``clean-off`` is the
screening's cost on an honest run.

    diloco bench attacks                          # every arm, 3 seeds (about 25 min on 2 cores, --jobs 2)
    diloco bench attacks --arms minus-9x --seeds 1
    diloco bench attacks --arms minus-9x,sign-flip outer.optimizer=sparseloco   # SparseLoCo's top-k
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from diloco.bench import seeds
from diloco.bench.arms import Arm, add_arm_flags, default_data, loss_ratio, rows_by_arm, run_arms
from diloco.errors import UsageError

WORKERS, SYNC_EVERY, ATTACKER = 4, 50, 3
OUTER = ("outer.optimizer=nesterov", "outer.lr=1.0", "outer.momentum=0.8")
SCREENED = ("comm.trust=open", "comm.max_norm_ratio=10", "comm.max_weight_ratio=4")  # what a reachable run gets
UNSCREENED = ("comm.trust=trusted", "comm.max_norm_ratio=0", "comm.max_weight_ratio=0")
ATTACKS: dict[str, tuple[str, ...]] = {
    "clean": (),
    "sign-flip": ("faults.bad_payload=scaled", "faults.payload_scale=-1"),
    "minus-9x": ("faults.bad_payload=scaled", "faults.payload_scale=-9"),
    "9x": ("faults.bad_payload=scaled", "faults.payload_scale=9"),
    "free-rider": ("faults.bad_payload=scaled", "faults.payload_scale=0"),
    "weight-1000x": ("faults.weight_scale=1000",),
    "noise": ("faults.bad_payload=noise",),
    "replay": ("faults.bad_payload=replay",),
}
# two attackers of eight, in league: (arm, attack), compared with CLEAN_8
LEAGUE, CLEAN_8 = {"sign-flip-2-of-8": "sign-flip", "minus-9x-2-of-8": "minus-9x"}, "clean-8"
UNSCREENED_ARMS = ("clean", "minus-9x")  # run again with every screen off
WITHOUT = "without-3"  # worker 3 left out of every round
TARGET = 1.02  # an attacked run's loss over the clean run's
COST_TARGET = 1.005  # the screened clean run's loss over the unscreened one's


def _arms() -> list[Arm]:
    arms = []
    for name, attack in ATTACKS.items():
        faults = (f"faults.worker={ATTACKER}", *attack) if attack else ()
        arms.append(Arm(name, WORKERS, SYNC_EVERY, (*OUTER, *SCREENED, *faults)))
        if name in UNSCREENED_ARMS:
            arms.append(Arm(f"{name}-off", WORKERS, SYNC_EVERY, (*OUTER, *UNSCREENED, *faults)))
    zeros_left_out = (*ATTACKS["free-rider"], "comm.min_cosine=0.1")  # cosine 0: below 0.1
    arms.append(Arm(WITHOUT, WORKERS, SYNC_EVERY, (*OUTER, *SCREENED, f"faults.worker={ATTACKER}", *zeros_left_out)))
    arms.append(Arm(CLEAN_8, 8, SYNC_EVERY, (*OUTER, *SCREENED)))
    for name, attack in LEAGUE.items():
        arms.append(
            Arm(name, 8, SYNC_EVERY, (*OUTER, *SCREENED, "faults.worker=6", "faults.count=2", *ATTACKS[attack]))
        )
    return arms


def _base(name: str) -> str | None:
    """The arm whose loss ``name``'s is divided by: the clean run of as many workers (the clean
    run's own: the one with every screen off)."""
    if name in ("clean-off", WITHOUT, CLEAN_8):
        return None
    if name == "clean":
        return "clean-off"
    return CLEAN_8 if name in LEAGUE else "clean"


ARMS = _arms()


def _rounds(run_dir: Path) -> list[dict]:
    """Worker 0's round records."""
    path = Path(run_dir) / "worker-0.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in records if r.get("event") == "round"]


def rounds_with_drops(run_dir: Path, workers: int) -> tuple[int, int]:
    """(rounds averaged over fewer than all ``workers``, rounds) in worker 0's records."""
    rounds = _rounds(run_dir)
    return sum(r.get("peers", workers) < workers for r in rounds), len(rounds)


def excluded_from(run_dir: Path) -> dict[int, int]:
    """The workers excluded (``comm.exclude_after``), each with the first round whose record of
    worker 0 lists it."""
    first: dict[int, int] = {}
    for record in _rounds(run_dir):
        for worker in record.get("excluded", []):
            first.setdefault(worker, record["round"])
    return first


def _exclusions(first: dict[int, int]) -> str:
    """``3 (r3)``: who was excluded and from which round; "-" for nobody."""
    return ", ".join(f"{worker} (r{round_})" for worker, round_ in sorted(first.items())) or "-"


def _collect(runs: list[dict]) -> dict:
    by_arm = rows_by_arm(runs)
    for run in runs:
        run["rounds_with_drops"], run["rounds"] = rounds_with_drops(run["run_dir"], run["workers"])
        run["excluded"] = _exclusions(excluded_from(run["run_dir"]))
    for name, row in by_arm.items():
        seeds = [r for r in sorted(runs, key=lambda r: r["seed"]) if r["arm"] == name]
        row["rounds_with_drops"] = [r["rounds_with_drops"] for r in seeds]
        row["excluded"] = [r["excluded"] for r in seeds]
        base, without = by_arm.get(_base(name) or ""), by_arm.get(WITHOUT)
        if base is not None:
            row["ratio_to_clean"] = loss_ratio(row, base)
        if without is not None and _base(name) == "clean":  # an attack by worker 3 of 4
            row["ratio_to_without"] = loss_ratio(row, without)
    return {"arms": by_arm, "runs": runs, "target": TARGET, "cost_target": COST_TARGET}


def table(results: dict) -> str:
    lines = [
        "| arm | final val loss per seed | mean | / clean | / without-3 | rounds with a contribution left out "
        "| excluded (from round) | target |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm in ARMS:
        row = results["arms"].get(arm.name)
        if row is None:
            continue
        losses = row["final_val_loss"]
        ratio, to_without = row.get("ratio_to_clean"), row.get("ratio_to_without")
        if arm.name == "clean":
            target, versus = f"<= {COST_TARGET} x clean-off, no drop", " (/ clean-off)"
        elif _base(arm.name) is None or arm.name.endswith("-off"):
            target, versus = "-", ""
        else:
            target, versus = f"<= {TARGET}", "" if _base(arm.name) == "clean" else f" (/ {CLEAN_8})"
        lines.append(
            f"| {arm.name} | {', '.join(f'{v:.4f}' for v in losses)} | {statistics.mean(losses):.4f} | "
            f"{f'{ratio:.4f}{versus}' if ratio else '-'} | {f'{to_without:.4f}' if to_without else '-'} | "
            f"{', '.join(map(str, row['rounds_with_drops']))} | {'; '.join(row.get('excluded', []))} | {target} |"
        )
    return "\n".join(lines)


def select_arms(names: Sequence[str]) -> list[Arm]:
    """The arms named (all when none is) and the clean arms they are compared with; ``UsageError``
    naming an unknown one."""
    if not names:
        return list(ARMS)
    known = [arm.name for arm in ARMS]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise UsageError(f"--arms: {unknown[0]!r} is not one of {', '.join(known)}")
    wanted = {*names, "clean", "clean-off", WITHOUT, *([CLEAN_8] if set(names) & set(LEAGUE) else [])}
    return [arm for arm in ARMS if arm.name in wanted]


def add_arguments(parser) -> None:
    """``diloco bench attacks``'s flags."""
    add_arm_flags(parser, steps=600, out="runs/bench-attacks")
    parser.add_argument("--arms", default="", help="comma-separated arms (default all; each brings the clean ones)")


def main(args) -> int:
    out = Path(args.out)
    results, _ = run_arms(
        "attacks",
        select_arms([name for name in args.arms.split(",") if name]),
        data_path=default_data(args.data),
        steps=args.steps,
        seeds=seeds(args),
        out=out,
        jobs=args.jobs,
        device=args.device,
        overrides=args.overrides,
        collect=_collect,
        first=("clean", "clean-off"),
    )
    print(table(results))
    print(f"wrote {out / 'results.json'}")
    return 0
