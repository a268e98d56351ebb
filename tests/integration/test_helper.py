"""A run whose workers are all behind NAT averages through a public helper (``diloco helper``), in
real network namespaces with masquerading NAT. Root and iptables only; skipped elsewhere with the
testbed's reason."""

from __future__ import annotations

import re
import signal
import time

import pytest

from diloco.bench.faults import Cluster
from diloco.comm.bounds import round_limit_s
from diloco.tools import testbed as nets
from diloco.tools.testbed import Testbed, leftovers
from tests.conftest import TINY, read_records

pytestmark = [
    pytest.mark.integration,
    pytest.mark.xdist_group("testbed"),  # see test_testbed.py
    pytest.mark.timeout(300),
    pytest.mark.skipif(nets.testbed_unavailable(nat=True) is not None, reason=str(nets.testbed_unavailable(nat=True))),
]

DEADLINE_S = 20.0
FAST = [*TINY, "comm.hivemind.matchmaking_s=8", f"comm.deadline_s={DEADLINE_S:g}"]
REDUCED = re.compile(r"^round (\d+): reduced parts for (\d+) workers", re.MULTILINE)


def _rounds(run_dir, worker: int) -> list[dict]:
    return [r for r in read_records(run_dir, worker) if r["event"] == "round"]


def _reduced(log: str) -> dict[int, int]:
    """round -> workers, for each round the helper's log says it reduced."""
    return {int(r): int(w) for r, w in REDUCED.findall(log)}


def test_three_workers_all_behind_nat_average_every_round_through_a_public_helper(diloco_cli, tmp_path):
    run_dir = tmp_path / "run"
    before = set(leftovers())
    # clients serve no state: one left out of a round (it came later than matchmaking_s after the
    # others, as a worker starting slowly on a busy machine may) could not catch up: a wide window
    done = diloco_cli(
        "testbed", "--workers", "3", "--nat", "0,1,2", "--helpers", "1", "--run-dir", str(run_dir),
        *FAST, "inner.steps=80", "outer.sync_every=20", "comm.hivemind.matchmaking_s=15", "comm.deadline_s=30",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    helper_log = (run_dir / "helper-0.log").read_text()
    reduced = _reduced(helper_log)
    # the helper starts once the workers announce what they average: it may miss the first round
    assert len(reduced) >= 3 and set(reduced.values()) == {3}, helper_log[-3000:]
    first = min(reduced)
    rounds = [_rounds(run_dir, worker) for worker in range(3)]
    for worker in range(3):
        log = (run_dir / f"worker-{worker}.log").read_text()
        assert "not reachable from outside" in log, log[-2000:]  # each is a client
        assert all(r["ok"] and r["peers"] == 3 for r in rounds[worker] if r["round"] >= first), rounds[worker]
        # a round before the helper was up is postponed: no outer step, the same params everywhere
        assert all(r.get("postponed") for r in rounds[worker] if r["round"] < first), rounds[worker]
    for index in range(len(rounds[0])):
        assert len({worker[index]["param_sha256"] for worker in rounds}) == 1, index
    assert set(leftovers()) <= before


def test_a_helper_killed_mid_run_costs_a_bounded_round_and_the_run_goes_on_through_the_other(tmp_path):
    run_dir = tmp_path / "run"
    # slowed to about 30 s of steps: time for the helpers to start and for rounds after the kill. Worker
    # 0 is public: a round the kill breaks leaves the others a state to take (clients serve none)
    overrides = [*FAST, "inner.steps=160", "outer.sync_every=20", "worker.count=3", "faults.step_delay_s=0.15"]
    testbed = Testbed(5, up_mbit=0, down_mbit=0, nat=[1, 2])  # the last two: the helpers, public
    with testbed, Cluster(overrides, run_dir, slots=3, testbed=testbed) as cluster:
        for worker in range(3):
            cluster.start(worker)
        helpers = [cluster.helper(slot, log_name=f"helper-{slot - 3}.log") for slot in (3, 4)]
        logs = [run_dir / f"helper-{i}.log" for i in range(2)]
        deadline = time.monotonic() + 180
        while not _reduced(logs[0].read_text() if logs[0].exists() else ""):
            assert time.monotonic() < deadline and helpers[0].poll() is None, "helper 0 reduced no round"
            time.sleep(0.5)  # polling a file another process writes
        killed_after = max(_reduced(logs[0].read_text()))
        helpers[0].send_signal(signal.SIGKILL)
        codes = cluster.wait_all(timeout_s=240)
    assert codes == {0: 0, 1: 0, 2: 0}, codes
    rounds = [_rounds(run_dir, worker) for worker in range(3)]
    later = [r for worker in rounds for r in worker if r["round"] > killed_after + 1]
    assert all(r["comm_s"] <= round_limit_s(DEADLINE_S) for r in later), later
    # the other helper carries the rounds after the kill, to the end
    assert [max(r["round"] for r in worker) for worker in rounds] == [8, 8, 8]
    assert all(worker[-1]["ok"] and worker[-1]["peers"] == 3 for worker in rounds), rounds
    assert any(round_ > killed_after + 1 for round_ in _reduced(logs[1].read_text())), logs[1].read_text()[-2000:]
    ends = [next(r for r in read_records(run_dir, w) if r["event"] == "end") for w in range(3)]
    assert len({end["param_sha256"] for end in ends}) == 1, ends
