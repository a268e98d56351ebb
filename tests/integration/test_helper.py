"""A run whose workers are all behind NAT averages through a public helper (``diloco helper``), in
real network namespaces with masquerading NAT. Root and iptables only; skipped elsewhere with the
testbed's reason."""

from __future__ import annotations

import re

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
    rounds = [round_records(run_dir, worker) for worker in range(3)]
    for worker in range(3):
        log = (run_dir / f"worker-{worker}.log").read_text()
        assert "not reachable from outside" in log, log[-2000:]  # each is a client
        assert all(r["ok"] and r["peers"] == 3 for r in rounds[worker] if r["round"] >= first), rounds[worker]
        # a round before the helper was up is postponed: no outer step, the same params everywhere
        assert all(r.get("postponed") for r in rounds[worker] if r["round"] < first), rounds[worker]
    for index in range(len(rounds[0])):
        assert len({worker[index]["param_sha256"] for worker in rounds}) == 1, index
    assert set(leftovers()) <= before
