"""A run whose workers are all behind NAT averages through public helpers (``diloco helper``), in
real network namespaces with masquerading NAT: the run goes on through the second helper once the
first is killed, and a worker that sits out the last round takes the run's state through a helper
(the others stay for it after their last round); a volunteer behind NAT joins such a run mid-way,
taking its state through a helper. Root and iptables only;
skipped elsewhere with the testbed's reason."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path

import pytest

from diloco.bench.faults import Cluster, written_records
from diloco.tools import testbed as nets
from diloco.tools.testbed import Testbed, leftovers
from tests.conftest import TINY, log_tails, round_records

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


def _kill_after_round(run_dir: Path, round_: int, slot: int, before: set[str], stop: threading.Event) -> int | None:
    """Once every worker of ``run_dir`` has recorded round ``round_`` or a later one (the round is
    over for all: a helper that logged its part reduced may still be sending it back), SIGKILL
    everything in the namespace of testbed slot ``slot`` (the helper and its daemon: the machine
    gone) and return the last round every worker had recorded then; None if ``stop`` came first."""
    while not stop.wait(0.2):  # polls the workers' records: the round is over
        recorded = [[r["round"] for r in written_records(run_dir, w) if r["event"] == "round"] for w in range(3)]
        done = min(max(rounds, default=0) for rounds in recorded)
        if done >= round_:
            break
    else:
        return None
    (namespace,) = [name for name in set(leftovers()) - before if name.startswith("dln") and name.endswith(f"w{slot}")]
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    subprocess.run(["kill", "-9", *pids], check=False)
    return done


# helper 0 is killed once every worker has recorded this round: the round after the kill may leave
# a worker out, which takes the others' state at the round after that; a round of slack before the
# last (the kill may come a round late: the next round's group can form in half a second)
KILLED_AFTER = 3
SKIPPED = 7  # worker 2 sits out this round, the last: the others average without it, and it takes their state


def test_a_run_of_clients_averages_through_helpers_relays_a_state_and_outlives_a_helper(diloco_cli, tmp_path):
    run_dir = tmp_path / "run"
    before = set(leftovers())
    killed: list[int | None] = []
    stop = threading.Event()
    kill = lambda: killed.append(_kill_after_round(run_dir, KILLED_AFTER, 3, before, stop))  # noqa: E731
    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    try:
        done = diloco_cli(
            "testbed", "--workers", "3", "--nat", "0,1,2", "--helpers", "2", "--run-dir", str(run_dir),
            *FAST, f"inner.steps={SKIPPED * 20}", "outer.sync_every=20", "comm.hivemind.matchmaking_s=7",
            "comm.deadline_s=30", "faults.worker=2", f"faults.skip_round={SKIPPED}",
            # the killed helper's record is gone 6 s after its last heartbeat: only the round it was
            # killed before waits the matchmaking window for it (as the last round waits for worker 2)
            "comm.hivemind.heartbeat_s=1.5",
        )  # fmt: skip
    finally:
        stop.set()
        killer.join(timeout=30)
    assert done.returncode == 0, done.stdout[-3000:]
    helper_logs = [(run_dir / f"helper-{h}.log").read_text() for h in range(2)]
    assert killed and killed[0], helper_logs[0][-3000:]
    reduced = [_reduced(log) for log in helper_logs]
    kill_round = killed[0]
    tails = "\n".join(log[-2000:] for log in helper_logs)
    seen = f"round: workers reduced, by helper: {reduced}; helper 0 killed after round {kill_round}\n{tails}"
    # the helpers reduce parts of each round for all three workers (for two in the round sat out);
    # after the kill, helper 1 alone, and a round after it may group only two workers: the killed
    # helper's record lives on for a heartbeat TTL, and a worker that picked it is left out
    for by_round in reduced:
        for r, w in by_round.items():
            assert w == 2 if r == SKIPPED else (w in (2, 3) if r > kill_round else w == 3), seen
    after_kill = [r for r in reduced[1] if r > kill_round]
    assert len(after_kill) >= 2, seen
    # the state after the last round, sat out by worker 2, went through helper 1: a client uploaded it
    # (the clients stay after their last round while one is behind), worker 2 took it
    assert any(f"holding the state after round {SKIPPED} uploaded" in log for log in helper_logs), helper_logs
    assert "took the state of a peer (2 peers)" in (run_dir / "worker-2.log").read_text()
    # the helpers start once the workers announce what they average: they may miss the first round,
    # and a worker whose first round began before both were up may lose the parts of the one that was not
    first = min([*reduced[0], *reduced[1]])
    assert first <= 2, seen
    rounds = [round_records(run_dir, worker) for worker in range(3)]
    for worker in range(3):
        log = (run_dir / f"worker-{worker}.log").read_text()
        assert "not reachable from outside" in log, log[-2000:]  # each is a client
        steady = [r for r in rounds[worker] if first < r["round"] <= kill_round and r["round"] != SKIPPED]
        assert all(r["ok"] and r["peers"] == 3 for r in steady), rounds[worker]
        # a round before the helpers were up is postponed: no outer step, the same params everywhere
        assert all(r.get("postponed") for r in rounds[worker] if r["round"] < first), rounds[worker]
    (sat_out,) = [r for r in rounds[2] if r["round"] == SKIPPED]
    assert not sat_out["ok"] and sat_out["recovered"], sat_out
    # identical params after every round up to the kill
    for by_worker in zip(*rounds):
        if by_worker[0]["round"] <= kill_round:
            assert len({r["param_sha256"] for r in by_worker}) == 1, by_worker
    # the round after the kill may leave a worker out of its group (it then takes the others' state
    # through helper 1 at the next round); the run ends on one model, the last round averaged by the
    # two that did not sit it out
    last = [worker[-1] for worker in rounds]
    assert [r["round"] for r in last] == [SKIPPED] * 3 and len({r["param_sha256"] for r in last}) == 1, last
    if kill_round < SKIPPED - 2:  # the round that may leave a worker out came before the one before the last
        outcome = [{k: r.get(k) for k in ("round", "ok", "peers", "recovered", "partial", "error")} for r in last]
        assert all(r["ok"] and r["peers"] == 2 for r in last[:2]), (outcome, seen, log_tails(run_dir, 3))
    assert set(leftovers()) <= before


def test_a_volunteer_behind_nat_joins_a_run_of_clients_mid_way_taking_its_state_through_a_helper(tmp_path):
    run_dir = tmp_path / "run"
    joined = run_dir / "joined"  # the workers train paced until the newcomer averaged with them
    overrides = [
        *FAST, "comm.hivemind.matchmaking_s=15", "comm.deadline_s=30", "comm.run_id=clients",
        "worker.count=2", "worker.slots=3", "inner.steps=200", "outer.sync_every=20",
        "faults.step_delay_s=0.1", f"faults.step_delay_until={joined}",
    ]  # fmt: skip
    before = set(leftovers())
    # workers 0 and 1 and the newcomer (2) behind NAT, the helper (3) public
    with (
        Testbed(4, up_mbit=0, down_mbit=0, nat=[0, 1, 2]) as testbed,
        Cluster(overrides, run_dir, slots=4, testbed=testbed) as cluster,
    ):
        cluster.start(0)
        cluster.start(1)
        cluster.helper(3, log_name="helper.log")
        cluster.wait_for_step(0, 2 * 20, 120)  # mid-way: after round 2 of 10
        cluster.processes[2] = cluster.join(slot=2, log_name="worker-2.log", only_address=True)
        try:
            cluster.wait_for_record(2, lambda record: record["ok"] and record["peers"] == 3, 120)
        finally:
            joined.touch()
        codes = cluster.wait_all(120)
    logs = {name: (run_dir / f"{name}.log").read_text() for name in ("worker-0", "worker-1", "worker-2", "helper")}
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, logs["worker-2"][-3000:])
    assert "not reachable from outside" in logs["worker-2"], logs["worker-2"][-3000:]  # a client
    # nobody serves a state in a run of clients: it came through the helper, at its start or (it
    # started as a round ended: a round behind) after its first round failed
    took = re.search(r"took the state (of a peer \(\d peers\) )?after round", logs["worker-2"])
    assert took, logs["worker-2"][-3000:]
    assert "holding the state after round" in logs["helper"], logs["helper"][-3000:]
    # the run ends on one model. Its last round is usually averaged by all three; hivemind's
    # matchmaking may leave one out of it (the other two then average without it, and it takes
    # their state through the helper: its record says recovered)
    rounds = [round_records(run_dir, worker) for worker in range(3)]
    last = [worker[-1] for worker in rounds]
    assert len({r["param_sha256"] for r in last}) == 1, last
    averaged = [r for r in last if r["ok"]]
    assert len(averaged) >= 2 and all(r["peers"] == len(averaged) for r in averaged), last
    assert all(r["ok"] or r["recovered"] for r in last), last
    assert set(leftovers()) <= before
