"""Volunteer runs with real worker processes: the fault scenarios of ``diloco bench faults``,
small (3 workers, the tiny model), on loopback (the slow-link one in the testbed, as root).

The bad-peer scenario has its tests where the dropping happens: a NaN sender in
tests/integration/test_compression_wire.py, a 100 x sender in tests/integration/test_local_run.py."""

from __future__ import annotations

import signal

import pytest

from diloco.bench.faults import Cluster, FaultRun, run_scenario
from diloco.tools import testbed as nets  # not its function by name: pytest would collect test*() as a test
from tests.conftest import TINY, read_records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

DEADLINE_S = 30.0
STEPS, SYNC_EVERY = 200, 20


def _plan(steps: int = STEPS, *, matchmaking_s: float = 8.0, outage_s: float = 5.0, **settings) -> FaultRun:
    return FaultRun(
        overrides=[
            *TINY,
            f"comm.hivemind.matchmaking_s={matchmaking_s:g}",
            f"comm.deadline_s={DEADLINE_S:g}",
            "logging.log_every=10",
        ],
        workers=3,
        steps=steps,
        sync_every=SYNC_EVERY,
        outage_s=outage_s,
        join_round=1,
        timeout_s=180.0,
        **settings,
    )


def _check_run(result, *, workers: int = 3, steps: int = STEPS) -> None:
    assert result.params_agree, result
    assert result.rounds_completed == steps // SYNC_EVERY, result
    assert set(result.exit_codes.values()) == {0} and len(result.exit_codes) == workers, result
    # a round's sync may add a short state download to its deadline (OuterStep.sync), never more
    assert result.longest_sync_s <= DEADLINE_S + 10.0, result


def test_a_worker_killed_mid_round_restarts_and_takes_the_runs_state(tmp_path):
    # 15 rounds: the others must still be there when the restart (2 s, then process start-up, slow
    # on a loaded machine) comes up, or it has nobody to take the run's state from
    result = run_scenario("crash", _plan(steps=300, outage_s=2.0), tmp_path)
    _check_run(result, steps=300)
    log = (tmp_path / "crash" / "worker-2.log").read_text()
    assert "worker 2 resumed at step" in log  # from its own checkpoint, a round behind the run,
    # so it took a peer's state (before its first round, or in it); only on a machine fast enough to
    # restart it before the others close the round it died in does it average in that round instead
    first = next(r for r in read_records(tmp_path / "crash", 2) if r["event"] == "round" and r["round"] > 2)
    assert "took the state" in log or (first["round"] == 3 and first["peers"] == 3), first


def test_a_worker_cut_off_for_a_while_ends_with_the_others_params(tmp_path):
    # cut off in round 3 (at step 50) for 2 s, inside the others' matchmaking window (8 s), back for
    # rounds 4 and 5: the rounds after those add nothing
    _check_run(run_scenario("cut", _plan(steps=100, outage_s=2.0), tmp_path), steps=100)


def test_a_run_whose_other_worker_was_killed_goes_on_alone_without_waiting_out_its_deadlines(tmp_path):
    # deadlines that add up past the 200 s the test waits: a survivor that waited for the dead worker in
    # every round (it used to, comm.deadline_s each) could not finish in time. The wait it does have is
    # the roster's: the survivor's next round waits until the dead worker is taken for gone, 8
    # heartbeats after its last (1 s here: 24 s at the default); then every round is taken alone at
    # once (the dead worker's offer left in the DHT is not waited for at the end)
    overrides = [*TINY, "worker.count=2", "inner.steps=120", "outer.sync_every=20", "comm.deadline_s=60",
                 "comm.hivemind.matchmaking_s=5", "comm.hivemind.heartbeat_s=1"]  # fmt: skip
    run_dir = tmp_path / "shrink"
    with Cluster([*overrides, "comm.run_id=shrink", "logging.log_every=10"], run_dir, slots=2) as cluster:
        for i in range(2):
            cluster.start(i)
        cluster.wait_for_step(1, 30, timeout_s=120)
        cluster.signal(1, signal.SIGKILL)
        cluster.processes[1].wait()
        assert cluster.processes[0].wait(timeout=200) == 0
    rounds = [r for r in read_records(run_dir, 0) if r["event"] == "round"]
    assert len(rounds) == 6 and rounds[-1]["peers"] == 1 and rounds[-1]["ok"], rounds
    assert "no other worker of the run is live" in (run_dir / "worker-0.log").read_text()


def test_a_newcomer_joins_a_live_run_and_averages_with_others_within_its_first_rounds(tmp_path):
    result = run_scenario("join", _plan(steps=240), tmp_path)  # the scenario keeps it going until the newcomer is up
    _check_run(result, workers=4, steps=240)
    rounds = [r for r in read_records(tmp_path / "join", 3) if r["event"] == "round"]
    others = {r["round"]: r for r in read_records(tmp_path / "join", 0) if r["event"] == "round"}
    # usually all 4 average together in the newcomer's first round; hivemind's matchmaking may split
    # a round into two groups of 2 (then the groups agree on one group's average: outer.py,
    # StateRank), or the others close the newcomer's first round a moment before it is ready (it
    # takes their state and averages from its second round on), or a part of that round is lost
    # (two workers retry as a pair, the newcomer and worker 0 end the round alone; the next round
    # meets the two models and the run is one again the round after). In one of its first three
    # rounds it averaged with others and ended on worker 0's params
    agreed = [r for r in rounds[:3] if r["peers"] >= 2 and r["param_sha256"] == others[r["round"]]["param_sha256"]]
    assert agreed, (rounds[:3], [others.get(r["round"]) for r in rounds[:3]])
    log = (tmp_path / "join" / "worker-3.log").read_text()
    assert "joining run 'faults_join' as worker 3" in log
    assert "took the run's config from a live peer (sha256 " in log  # it passed no config file, no model keys


def test_a_peer_without_the_run_key_is_refused_every_time(tmp_path):
    # long enough for the join attempt (process start-up and its search) to end while the run is live
    # the benchmark tries 3 times; a join's roster probe lasts comm.hivemind.matchmaking_s
    result = run_scenario("wrong_key", _plan(key_attempts=1, matchmaking_s=5.0), tmp_path)
    _check_run(result)
    assert "diloco join with the wrong key refused 1 of 1 times while the run was live" in result.notes
    assert "wrong-key worker tried to average while the run was live: yes" in result.notes
    assert "comm.run_key" in (tmp_path / "wrong_key" / "wrong-key-0.log").read_text()
    for i in range(3):  # the keyed workers never averaged with a fourth
        assert all(r["peers"] <= 3 for r in read_records(tmp_path / "wrong_key", i) if r["event"] == "round")


@pytest.mark.skipif(nets.testbed_unavailable() is not None, reason="the testbed needs root and iproute2")
@pytest.mark.xdist_group("testbed")  # with the testbed's own tests, one at a time (test_testbed.py)
def test_a_worker_on_a_link_ten_times_slower_holds_no_round_past_its_deadline(tmp_path):
    # the slow link is there from the first round: two rounds (about 4 s each) show it as well as more
    _check_run(run_scenario("slow", _plan(steps=40, rate_mbit=20.0), tmp_path), steps=40)


def test_time_budgeted_rounds_let_a_slower_worker_run_fewer_steps_and_still_agree(tmp_path, diloco_cli):
    """outer.round_s: each worker runs as many inner steps as it can in 1 s a round; worker 1
    computes 4 x slower (faults.step_delay_s), so it runs fewer, and its pseudo-gradient weighs less."""
    run_dir = tmp_path / "timed"
    done = diloco_cli(
        "local", "--workers", "2", "--run-dir", str(run_dir), *TINY,
        "inner.steps=60", "outer.sync_every=20", "outer.round_s=1", "faults.worker=1", "faults.step_delay_s=0.03",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    ends = [next(r for r in read_records(run_dir, i) if r["event"] == "end") for i in range(2)]
    assert ends[0]["rounds"] == ends[1]["rounds"] == 3 and ends[0]["param_sha256"] == ends[1]["param_sha256"]
    assert ends[0]["inner_steps"] > 1.5 * ends[1]["inner_steps"] > 0, ends
