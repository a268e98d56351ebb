"""The shaped-network testbed: real workers in real network namespaces on tbf-limited links.

Root only (CI runs as root); skipped elsewhere with the reason the testbed itself gives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from diloco.comm.simulator import round_time_s
from diloco.tools import testbed as nets  # not its function by name: pytest would collect test*() as a test
from diloco.tools.testbed import _NAME, leftovers, remove_stale
from tests.conftest import TINY, read_records

needs_root = pytest.mark.skipif(nets.testbed_unavailable() is not None, reason=str(nets.testbed_unavailable()))
# one test process runs every test that builds a testbed (launch/test.sh: --dist loadgroup): these
# compare the testbeds that exist before and after, and a testbed's build removes dead owners' leftovers
pytestmark = pytest.mark.xdist_group("testbed")

SMALL = [*TINY, "model.n_layer=1", "model.n_embd=32", "comm.hivemind.matchmaking_s=8"]


def _owned_by(pid: int) -> list[str]:
    return [name for name in leftovers() if str(pid) in name]


@needs_root
@pytest.mark.timeout(240)
def test_a_slow_link_sets_the_round_time_the_simulators_link_model_predicts(diloco_cli, tmp_path):
    rate_mbit = 1.0
    run_dir = tmp_path / "run"
    before = set(leftovers())
    done = diloco_cli(
        "testbed", "--workers", "2", "--rate", str(rate_mbit), "--run-dir", str(run_dir),
        *TINY, "inner.steps=20", "outer.sync_every=10", "checkpoint.every_rounds=0",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert "links up 1 Mbit/s, down 1 Mbit/s" in done.stdout
    rounds = [r for r in read_records(run_dir, 0) if r["event"] == "round"]
    theirs = [r for r in read_records(run_dir, 1) if r["event"] == "round"]
    assert len(rounds) == len(theirs) == 2
    # the rounds both averaged whole: under load hivemind can lose a reducer's part for one worker
    # (seen in CI), whose round then also waits for the state it takes
    by_round = [(a, b) for a, b in zip(rounds, theirs) if a["ok"] and b["ok"] and a["peers"] == b["peers"] == 2]
    assert by_round, (rounds, theirs)
    # two workers: each sends half its payload out and half back as averages, all over its own link
    payload = by_round[0][0]["bytes_sent"]
    model_s = round_time_s(payload, 2, bandwidth_mbps=rate_mbit, latency_ms=0)
    assert model_s > 3, "the model is too small for the link to show"
    # a round's time on the link: the later of the two to arrive waits for no one, so the lesser
    # comm_s of the two (worker 0's alone also counted its wait for a worker 1 slowed by a busy CI)
    # the quicker round: what the machine adds (a round's own work, a busy core, a process the test
    # before left to wind down) only ever adds time: 1.03-1.16 x the model alone, on 2 busy cores
    # or idle, and up to 1.39 x inside a whole suite
    measured_s = min(min(mine["comm_s"], other["comm_s"]) for mine, other in by_round)
    # within the noise of 2 shared cores, not 2 x off
    assert 0.75 <= measured_s / model_s <= 1.6, (measured_s, model_s)
    assert set(leftovers()) <= before


@needs_root
@pytest.mark.timeout(240)
def test_the_gloo_data_plane_averages_across_namespaces(diloco_cli, tmp_path):
    run_dir = tmp_path / "run"
    done = diloco_cli(
        "testbed", "--workers", "2", "--rate", "50", "--run-dir", str(run_dir),
        *SMALL, "inner.steps=20", "outer.sync_every=10", "comm.hivemind.data_plane=gloo",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    records = [read_records(run_dir, worker) for worker in range(2)]
    rounds = [[r for r in worker if r["event"] == "round"] for worker in records]
    assert [len(worker) for worker in rounds] == [2, 2], rounds
    # the rounds that both workers averaged whole: on 2 busy cores hivemind's matchmaking can end a
    # round for one worker only, which then fails within its bound (tested elsewhere)
    whole = [(a, b) for a, b in zip(*rounds) if a["ok"] and b["ok"] and a["peers"] == b["peers"] == 2]
    said = [[{k: r.get(k) for k in ("round", "ok", "peers", "error")} for r in worker] for worker in rounds]
    assert whole, (said, done.stdout[-4000:])
    assert all(a["param_sha256"] == b["param_sha256"] for a, b in whole), said
    # a ring all-reduce of 2 peers moves exactly the fp32 payload each way; hivemind's adds framing
    (param_count,) = {r["param_count"] for worker in records for r in worker if r["event"] == "end"}
    assert all(r["bytes_sent"] == 4 * param_count for pair in whole for r in pair), said


@needs_root
@pytest.mark.timeout(240)
def test_a_crashed_worker_leaves_no_namespace_or_link_behind(diloco_cli, tmp_path):
    before = set(leftovers())
    # worker 0's round 2 waits out comm.deadline_s for worker 1, which stopped after round 1: short
    done = diloco_cli(
        "testbed", "--workers", "2", "--rate", "50", "--run-dir", str(tmp_path / "run"),
        *SMALL, "inner.steps=20", "outer.sync_every=10", "comm.hivemind.matchmaking_s=3", "comm.deadline_s=5",
        "comm.hivemind.request_timeout_s=2",
        "faults.worker=1", "faults.stop_after_round=1",
    )  # fmt: skip
    assert done.returncode == 3, done.stdout[-3000:]  # worker 1 stopped as asked, worker 0 finished
    assert "worker 1 stopped (exit code 3): faults.stop_after_round=1 reached" in done.stdout
    assert set(leftovers()) <= before


@needs_root
@pytest.mark.timeout(120)
def test_the_leftovers_of_a_testbed_killed_with_sigkill_are_removed():
    code = "from diloco.tools.testbed import Testbed; import time; Testbed(2, up_mbit=5, down_mbit=5); print('up', flush=True); time.sleep(600)"  # noqa: E501
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        owned = [name for name in leftovers() if _owner(name) == holder.pid]
        assert len(owned) == 5  # 2 namespaces, 2 veths, 1 bridge
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        assert sorted(remove_stale()) == sorted(owned)
        assert [name for name in leftovers() if _owner(name) == holder.pid] == []
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)


def _owner(name: str) -> int:
    return int(_NAME.match(name).group(1), 36)  # the pid in base 36 may itself contain an "s"


def test_without_root_the_testbed_says_so_in_one_line(monkeypatch, capsys):
    from diloco.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["testbed", "--workers", "2", "--rate", "5", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "diloco: error: the network testbed needs root (network namespaces, veth pairs and tc); run it as root"
    )


@needs_root
@pytest.mark.timeout(240)
def test_the_allreduce_efficiency_benchmark_measures_a_small_payload(diloco_cli, tmp_path):
    done = diloco_cli(
        "bench", "utilization", "--parts", "allreduce", "--peers", "2", "--payload-mb", "1",
        "--allreduce-rate", "8", "--rounds", "2", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    (row,) = json.loads((tmp_path / "results.json").read_text())["allreduce"]
    # (every_round_complete is reported, not asserted: a reducer's last parts are sometimes lost, an
    # open bug that the blocking round survives by taking a peer's state)
    assert row["bound_s"] == pytest.approx(1.0) and len(row["rounds_s"]) == 1
    assert 0.2 < row["efficiency"] <= 1.05  # the link, not the loopback, sets the pace
