"""A newcomer takes the state of a live run in parts from the two workers that offer it, one of
which serves every part corrupt (``faults.corrupt_state_range``): that worker is refused, its
parts come from the other, and the newcomer ends on the run's params."""

from __future__ import annotations

import re

import pytest

from diloco.bench.faults import Cluster
from tests.conftest import TINY, log_tails, read_records
from tests.processes import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

DOWNLOADED = re.compile(
    r"downloaded the state of a peer after round \d+: \d+ bytes in [0-9.]+ s, in parts from \d+ peers"
)


def test_a_newcomer_refuses_a_peer_serving_corrupt_parts_and_takes_them_from_another(tmp_path):
    run_dir, release = tmp_path / "run", tmp_path / "release"
    # one config for all (a newcomer takes it from a live peer), the faults worker 1's: it serves
    # corrupt parts, and it is paced until the newcomer has its state (10 steps x 0.3 s a round;
    # worker 0 waits for it in each round's matchmaking): the run outlives the newcomer's start-up
    faults = ["faults.worker=1", "faults.corrupt_state_range=true", "faults.step_delay_s=0.3",
              f"faults.step_delay_until={release}"]  # fmt: skip
    settings = [*TINY, "worker.count=2", "worker.slots=3", "inner.steps=200", "outer.sync_every=10",
                "comm.run_id=parts", "checkpoint.every_rounds=0", *faults]  # fmt: skip
    with Cluster(settings, run_dir, slots=3) as cluster:
        cluster.start(0)
        cluster.start(1)
        cluster.wait_for_step(1, 20, timeout_s=120)
        joiner = cluster.join(slot=2, log_name="worker-2.log", only_address=True)
        log = run_dir / "worker-2.log"
        wait_for(lambda: DOWNLOADED.search(log.read_text()) or joiner.poll() is not None, 150, "the newcomer's state")
        release.touch()
        codes = {**cluster.wait_all(120), 2: joiner.wait(timeout=120)}
    logs = [(run_dir / f"worker-{w}.log").read_text() for w in range(3)]
    assert codes == {0: 0, 1: 0, 2: 0}, log_tails(run_dir, 3)
    corrupt_peer = re.search(r"worker 1 is up; join this run with: .*?/p2p/(\w+)", logs[1]).group(1)
    assert re.search(rf"peer {corrupt_peer} served part \d+ of the state corrupt: refused", logs[2]), logs[2][-3000:]
    assert DOWNLOADED.search(logs[2]), logs[2][-3000:]
    ends = [[r for r in read_records(run_dir, w) if r["event"] == "end"][0] for w in range(3)]
    assert len({end["param_sha256"] for end in ends}) == 1, ends  # the newcomer ends on the run's params
