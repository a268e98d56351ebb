"""The stock baselines of ``diloco bench scale`` (``scale.py``): 2 processes
(``diloco.bench.payload_peer``) average a model size's payload (its param count of fp32 values)
a number of times through stock ``hivemind.averaging.DecentralizedAverager`` (``hivemind``), or
through torch.distributed gloo ``all_reduce`` (``gloo``): the median of the rounds after the first."""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from diloco.lifetime import stop_all

BASELINES = ("hivemind", "gloo")
PEERS = 2


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
        for rank in range(PEERS):
            log = out / f"{kind}-peer-{rank}.log"
            peers.append(_start_peer(kind, rank, values=values, rounds=rounds, rendezvous=rendezvous, log=log))
        outputs = [peer.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for peer in peers]
    except subprocess.TimeoutExpired:
        return {"kind": kind, "error": f"no result within {bound_s:.0f} s; see {out}/{kind}-peer-*.log"}
    finally:
        stop_all(peers)
    reports = [json.loads(text.strip().splitlines()[-1]) for text in outputs if text.strip()]
    if len(reports) != PEERS or not all(all(report["ok"]) for report in reports):
        return {"kind": kind, "error": f"a peer failed; see {out}/{kind}-peer-*.log", "reports": reports}
    return {
        "kind": kind,
        "median_s": statistics.median(s for report in reports for s in report["round_s"][1:]),
        "round_s": [report["round_s"] for report in reports],
    }
