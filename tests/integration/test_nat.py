"""Volunteers behind home routers, in real network namespaces: masquerading NAT, no connection in
(``Testbed(nat=...)``), with the default config. Root and iptables only (``launch/test.sh`` installs
iptables when it runs as root, as CI does); skipped elsewhere with the testbed's reason."""

from __future__ import annotations

import pytest

from diloco.bench.faults import Cluster
from diloco.comm.bounds import round_limit_s
from diloco.tools import testbed as nets
from diloco.tools.testbed import Testbed, leftovers
from tests.conftest import TINY, log_tails, read_records, round_records

pytestmark = [
    pytest.mark.integration,
    pytest.mark.xdist_group("testbed"),  # see test_testbed.py
    pytest.mark.timeout(300),
    pytest.mark.skipif(nets.testbed_unavailable(nat=True) is not None, reason=str(nets.testbed_unavailable(nat=True))),
]

CLIENT = "not reachable from outside at 192.168."
FAST = [*TINY, "comm.hivemind.matchmaking_s=8", "comm.deadline_s=20"]


def test_workers_behind_nat_average_with_a_public_one_and_one_joining_mid_run_takes_the_runs_state(tmp_path):
    # before client mode was chosen by measurement, each NAT'd worker lost its parts every round.
    # With the gloo data plane asked for, the clients declare no endpoint: hivemind averages.
    # Round 1 every worker sits out (each applies its own pseudo-gradient): nobody can take a
    # client's state, so the client must take the public worker's, whatever their fingerprints.
    # A second client joins mid-run with diloco join (its own settings say a run of one: the run's
    # slots, 3, are what count), takes the run's state and averages with both; the workers train
    # paced until it has
    run_dir = tmp_path / "run"
    joined = run_dir / "joined"
    overrides = [
        *FAST, "inner.steps=120", "outer.sync_every=10", "worker.count=2", "worker.slots=3",
        "comm.hivemind.data_plane=gloo", "faults.skip_round=1",
        "faults.step_delay_s=0.15", f"faults.step_delay_until={joined}",
    ]  # fmt: skip
    before = set(leftovers())
    with (
        Testbed(3, up_mbit=0, down_mbit=0, nat=[1, 2]) as testbed,
        Cluster(overrides, run_dir, slots=3, testbed=testbed) as cluster,
    ):
        cluster.start(0)
        cluster.start(1)
        cluster.wait_for_step(0, 20, timeout_s=180)
        cluster.processes[2] = cluster.join(["worker.count=1", "worker.slots=0"], slot=2, log_name="worker-2.log")
        try:
            cluster.wait_for_record(2, lambda record: record["ok"] and record["peers"] == 3, 180)
        finally:
            joined.touch()
        codes = cluster.wait_all(timeout_s=240)
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, log_tails(run_dir, 3))
    logs = [(run_dir / f"worker-{w}.log").read_text() for w in range(3)]
    assert "reachable at 10.231." in logs[0] and CLIENT not in logs[0], logs[0][-2000:]
    for log in logs[1:]:
        assert CLIENT in log and "joining as a client" in log, log[-2000:]
        assert (
            "join this run with: comm.hivemind.initial_peers=['/ip4/10.231." in log
        )  # a dialable address, not its own
    assert "as worker 2 (2 live)" in logs[2] and "took the state after round" in logs[2], logs[2][-3000:]
    # a client that starts after the public worker sat out round 1 (at once) joins it after that
    # round instead (joining.py): its records begin at round 2. One that comes a moment after the
    # public worker formed round 2's group sees its offer of that round, stops looking and takes
    # it. Every worker averages a round with both others through the public worker, and ends its
    # last round whole or on a peer's state
    rounds = [round_records(run_dir, worker) for worker in range(3)]
    for worker in range(3):
        numbers = [r["round"] for r in rounds[worker]]
        assert numbers == sorted(set(numbers)) and numbers[-1] == 12, numbers
        assert any(r["ok"] and r["peers"] == 3 for r in rounds[worker]), (rounds, log_tails(run_dir, 3))
        assert rounds[worker][-1]["ok"] or rounds[worker][-1]["recovered"], (rounds, log_tails(run_dir, 3))
    assert rounds[0][0]["round"] == 1 and rounds[1][0]["round"] in (1, 2), rounds[:2]
    assert rounds[1][0]["round"] == 2 or not rounds[1][0]["ok"], rounds[1]
    ends = [next(r for r in read_records(run_dir, w) if r["event"] == "end") for w in range(3)]
    assert len({end["param_sha256"] for end in ends}) == 1, ends
    assert set(leftovers()) <= before


def test_with_client_mode_forced_off_no_worker_calls_a_round_ok_that_lost_parts(diloco_cli, tmp_path):
    # two NAT'd peers that are not clients cannot reach each other: the parts they would exchange are
    # lost. The public worker's reducer had every contribution, but the NAT'd reducers' parts it got
    # back did not: its records must not say ok (they did, with peers 3, before parts were counted)
    run_dir = tmp_path / "run"
    done = diloco_cli(
        "testbed", "--workers", "3", "--nat", "1,2", "--run-dir", str(run_dir),
        *FAST, "inner.steps=10", "outer.sync_every=10", "comm.hivemind.client_mode=false",
    )  # fmt: skip
    # 4: a worker whose round lost parts may end on params of its own, and diloco local says so
    assert done.returncode in (0, 4), done.stdout[-3000:]
    # hivemind's matchmaking puts all three in a round, or two (a NAT'd leader cannot be joined; one
    # came late); a round whole among two is ok. Over all three, some part always misses a NAT'd
    # worker's contribution: such a round is partial, never ok with 3
    for worker in range(3):
        rounds = round_records(run_dir, worker)
        assert rounds and not any(r["ok"] and r["peers"] == 3 for r in rounds), (worker, rounds)
    log = (run_dir / "worker-0.log").read_text()
    for record in round_records(run_dir, 0):
        if record["partial"]:
            assert not record["ok"] and record["peers"] == 2, record
            assert "part of the vector was averaged over only 2 of 3 contributions" in log


def test_a_run_no_worker_of_which_can_be_dialled_says_so_and_waits_no_longer_than_its_bounds(diloco_cli, tmp_path):
    run_dir = tmp_path / "run"
    # each round looks for a group until comm.deadline_s and finds none: a short one
    deadline_s = 5.0
    done = diloco_cli(
        "testbed", "--workers", "2", "--nat", "0,1", "--run-dir", str(run_dir),
        *FAST, f"comm.deadline_s={deadline_s:g}", "comm.hivemind.matchmaking_s=4",
        "inner.steps=20", "outer.sync_every=10",  # the last round: the first done leaves, the other is alone
    )  # fmt: skip
    # no round averages: the global params stay as they were (rounds postponed), or the last round,
    # which the first worker done leaves, is taken alone by the other: params that differ (exit 4)
    assert done.returncode in (0, 4), done.stdout[-3000:]
    for worker in range(2):
        log = (run_dir / f"worker-{worker}.log").read_text()
        assert CLIENT in log, log[-2000:]
        assert "no worker of the run that can be dialled is live" in log, log[-2000:]
        assert "forward a port and set comm.hivemind.announce_host, or start one worker on a public address" in log
        assert all(r["comm_s"] <= round_limit_s(deadline_s) for r in round_records(run_dir, worker))
