"""A run whose workers are all behind NAT averages through public helpers (``diloco helper``), in
real network namespaces with masquerading NAT, and goes on through the second helper once the first
is killed. Root and iptables only; skipped elsewhere with the testbed's reason."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path

import pytest

from diloco.tools import testbed as nets
from diloco.tools.testbed import leftovers
from tests.conftest import TINY, round_records

pytestmark = [
    pytest.mark.integration,
    pytest.mark.xdist_group("testbed"),  # see test_testbed.py
    pytest.mark.timeout(300),
    pytest.mark.skipif(nets.testbed_unavailable(nat=True) is not None, reason=str(nets.testbed_unavailable(nat=True))),
]

DEADLINE_S = 20.0
FAST = [*TINY, "comm.hivemind.matchmaking_s=8", f"comm.deadline_s={DEADLINE_S:g}"]
REDUCED = re.compile(r"^round (\d+): reduced parts for (\d+) workers", re.MULTILINE)


def _reduced(log: str) -> dict[int, int]:
    """round -> workers, for each round the helper's log says it reduced."""
    return {int(r): int(w) for r, w in REDUCED.findall(log)}


def _kill_when_reduced(log: Path, rounds: int, slot: int, before: set[str], stop: threading.Event) -> list[int]:
    """Once ``log`` says its helper reduced ``rounds`` rounds, SIGKILL everything in the namespace of
    testbed slot ``slot`` (the helper and its daemon: the machine gone) and return the rounds it
    reduced by then; [] if ``stop`` came first."""
    while not stop.wait(0.2):  # polls the helper's log: the record that says the round is over
        done = _reduced(log.read_text()) if log.exists() else {}
        if len(done) >= rounds:
            break
    else:
        return []
    (namespace,) = [name for name in set(leftovers()) - before if name.startswith("dln") and name.endswith(f"w{slot}")]
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    subprocess.run(["kill", "-9", *pids], check=False)
    return sorted(done)


def test_three_workers_all_behind_nat_average_every_round_through_public_helpers_and_outlive_one(diloco_cli, tmp_path):
    run_dir = tmp_path / "run"
    before = set(leftovers())
    killed: list[list[int]] = []
    stop = threading.Event()
    killer = threading.Thread(
        target=lambda: killed.append(_kill_when_reduced(run_dir / "helper-0.log", 2, 3, before, stop)), daemon=True
    )
    killer.start()
    try:
        # clients serve no state: one left out of a round (it came later than matchmaking_s after
        # the others, as a worker starting slowly on a busy machine may) could not catch up: a wide
        # window
        done = diloco_cli(
            "testbed", "--workers", "3", "--nat", "0,1,2", "--helpers", "2", "--run-dir", str(run_dir),
            *FAST, "inner.steps=120", "outer.sync_every=20", "comm.hivemind.matchmaking_s=15", "comm.deadline_s=30",
        )  # fmt: skip
    finally:
        stop.set()
        killer.join(timeout=30)
    assert done.returncode == 0, done.stdout[-3000:]
    helper_logs = [(run_dir / f"helper-{h}.log").read_text() for h in range(2)]
    assert killed and killed[0], helper_logs[0][-3000:]  # helper 0 reduced two rounds, then was killed
    reduced = [_reduced(log) for log in helper_logs]
    # both helpers reduce parts of each round for all three workers; after the kill, helper 1 alone
    assert set(reduced[0].values()) == {3} and set(reduced[1].values()) == {3}, helper_logs[1][-3000:]
    after_kill = [r for r in reduced[1] if r > max(killed[0])]
    assert len(after_kill) >= 2, helper_logs[1][-3000:]
    # the helpers start once the workers announce what they average: they may miss the first round
    first = min([*reduced[0], *reduced[1]])
    rounds = [round_records(run_dir, worker) for worker in range(3)]
    for worker in range(3):
        log = (run_dir / f"worker-{worker}.log").read_text()
        assert "not reachable from outside" in log, log[-2000:]  # each is a client
        assert all(r["ok"] and r["peers"] == 3 for r in rounds[worker] if r["round"] >= first), rounds[worker]
        # a round before the helpers were up is postponed: no outer step, the same params everywhere
        assert all(r.get("postponed") for r in rounds[worker] if r["round"] < first), rounds[worker]
    for index in range(len(rounds[0])):
        assert len({worker[index]["param_sha256"] for worker in rounds}) == 1, index
    assert set(leftovers()) <= before
