"""Volunteers behind home routers, in real network namespaces: masquerading NAT, no connection in
(``Testbed(nat=...)``), with the default config. Root and iptables only (``launch/test.sh`` installs
iptables when it runs as root, as CI does); skipped elsewhere with the testbed's reason."""

from __future__ import annotations

import json

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


def test_two_workers_behind_nat_average_with_a_public_one_and_agree_after_a_round_none_averaged(diloco_cli, tmp_path):
    # before client mode was chosen by measurement, each NAT'd worker lost its parts every round.
    # With the gloo data plane asked for, the clients declare no endpoint: hivemind averages.
    # Round 1 every worker sits out (each applies its own pseudo-gradient): nobody can take a
    # client's state, so each client must take the public worker's, whatever their fingerprints
    run_dir = tmp_path / "run"
    before = set(leftovers())
    done = diloco_cli(
        "testbed", "--workers", "3", "--nat", "1,2", "--rate", "20", "--run-dir", str(run_dir),
        *FAST, "inner.steps=40", "outer.sync_every=10", "comm.hivemind.data_plane=gloo", "faults.skip_round=1",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    logs = [(run_dir / f"worker-{w}.log").read_text() for w in range(3)]
    assert "reachable at 10.231." in logs[0] and CLIENT not in logs[0], logs[0][-2000:]
    for log in logs[1:]:
        assert CLIENT in log and "joining as a client" in log, log[-2000:]
        assert (
            "join this run with: comm.hivemind.initial_peers=['/ip4/10.231." in log
        )  # a dialable address, not its own
    # a client that starts after the public worker sat out round 1 (at once) joins it after that
    # round instead (joining.py): its records begin at round 2. One that comes a moment after the
    # other two formed round 2's group sees the public worker's offer of that round, stops looking
    # and takes it. Every worker averages a round with both others through the public worker, and
    # ends its last round whole or on a peer's state (on a loaded machine a client can miss the
    # last round's group by more than comm.hivemind.matchmaking_s: then it takes the state of the bigger group)
    for worker in range(3):
        numbers = [r["round"] for r in round_records(run_dir, worker)]
        assert numbers[0] in ((1,) if worker == 0 else (1, 2)) and numbers[-1] == 4, numbers
        assert numbers == sorted(set(numbers)), numbers
        rounds = round_records(run_dir, worker)
        assert rounds[0]["round"] == 2 or not rounds[0]["ok"], rounds
        assert any(r["ok"] and r["peers"] == 3 for r in rounds[1:]), (rounds, log_tails(run_dir, 3))
        assert rounds[-1]["ok"] or rounds[-1]["recovered"], (rounds, log_tails(run_dir, 3))
    hashes = [round_records(run_dir, worker)[-1]["param_sha256"] for worker in range(3)]
    assert hashes[0] == hashes[1] == hashes[2], hashes
    assert json.loads((run_dir / "summary.json").read_text())["params_agree"]
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
    assert done.returncode == 0, done.stdout[-3000:]
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


def test_a_worker_behind_nat_joining_mid_run_takes_the_runs_state(tmp_path):
    run_dir = tmp_path / "run"
    # slowed to about 18 s of steps, so that the run is still going when the joiner is up (~8 s)
    overrides = [*FAST, "inner.steps=120", "outer.sync_every=10", "worker.count=2", "worker.slots=3",
                 "faults.step_delay_s=0.15"]  # fmt: skip
    with Testbed(3, up_mbit=0, down_mbit=0, nat=[2]) as testbed, Cluster(overrides, run_dir, slots=3,
                                                                          testbed=testbed) as cluster:  # fmt: skip
        cluster.start(0)
        cluster.start(1)
        cluster.wait_for_step(0, 20, timeout_s=180)
        # the joiner's own settings say a run of one: the run's slots (3) are what count
        joiner = cluster.join(["worker.count=1", "worker.slots=0"], slot=2, log_name="worker-2.log")
        cluster.processes[2] = joiner
        codes = cluster.wait_all(timeout_s=240)
    assert codes == {0: 0, 1: 0, 2: 0}, codes
    log = (run_dir / "worker-2.log").read_text()
    assert "as worker 2 (2 live)" in log and CLIENT in log and "took the state after round" in log, log[-3000:]
    ends = [next(r for r in read_records(run_dir, w) if r["event"] == "end") for w in range(3)]
    assert len({end["param_sha256"] for end in ends}) == 1, ends
    assert any(r["ok"] and r["peers"] == 3 for r in round_records(run_dir, 2))  # it averaged with both, as a client


def test_a_run_no_worker_of_which_can_be_dialled_says_so_and_waits_no_longer_than_its_bounds(diloco_cli, tmp_path):
    run_dir = tmp_path / "run"
    # each round looks for a group until comm.deadline_s and finds none: a short one
    deadline_s = 10.0
    done = diloco_cli(
        "testbed", "--workers", "2", "--nat", "0,1", "--run-dir", str(run_dir),
        *FAST, f"comm.deadline_s={deadline_s:g}",
        "inner.steps=20", "outer.sync_every=10",  # the last round: the first done leaves, the other is alone
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    for worker in range(2):
        log = (run_dir / f"worker-{worker}.log").read_text()
        assert CLIENT in log, log[-2000:]
        assert "no worker of the run that can be dialled is live" in log, log[-2000:]
        assert "forward a port and set comm.hivemind.announce_host, or start one worker on a public address" in log
        assert all(r["comm_s"] <= round_limit_s(deadline_s) for r in round_records(run_dir, worker))
