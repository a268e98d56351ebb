"""A training benchmark's arm over real hivemind peers (``comm.backend=hivemind`` among the
overrides): the same worker loop as ``diloco local``, a process a worker on loopback, and the same
row in the results as a simulated arm's."""

from __future__ import annotations

import pytest

from diloco.bench.arms import Arm, Job, _run_one
from tests.conftest import TINY, read_records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_an_arm_runs_over_real_hivemind_peers_and_reports_as_a_simulated_one(tmp_path):
    job = Job(Arm("m2-h5", 2, 5), 0, "", 10, tmp_path, "cpu", 1, [*TINY, "comm.backend=hivemind"])
    run = _run_one(job)
    assert run["workers"] == 2 and run["params_agree"] and not run["reused"], run
    run_dir = tmp_path / "m2-h5-seed0"
    assert "worker 1 is up; join this run with" in (run_dir / "worker-1.log").read_text()  # its own process
    rounds = [r for r in read_records(run_dir, 0) if r["event"] == "round"]
    # averaged by both (a part hivemind lost under load makes a round partial or recovered, as in any run)
    assert len(rounds) == 2 and all(r["peers"] == 2 or r["partial"] or r["recovered"] for r in rounds), rounds
    assert _run_one(job)["reused"]  # and a rerun reuses it, as a simulated arm's
