"""``diloco status`` against a real DHT: a worker's heartbeat record published by a real roster
in this process, read by the real command through the peer's address."""

from __future__ import annotations

import threading
import time

import pytest

from diloco.comm.hivemind.peer import bounded_dht_call, start_dht, visible_addresses
from diloco.comm.hivemind.roster import Roster
from diloco.comm.hivemind.settings import HivemindConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def live_worker():
    """A DHT peer holding worker 1's roster record of run 'trial' (round 3, step 61, in a round's
    matchmaking for the last 75 s); its address, and when the phase's 75 s were counted from."""
    dht = start_dht(HivemindConfig(host="127.0.0.1", port=0), initial_peers=[])
    roster = Roster(bounded_dht_call(dht, threading.Lock(), timeout_s=10), run_id="trial", worker_index=1, planned=2)
    roster.progress(3, 61, {"loss": 2.5, "tokens_per_s": 1234.4, "val_loss": 2.61})
    set_at = time.time()
    roster.phase("averaging", set_at - 75)
    roster.stage("matchmaking")
    roster.start()
    try:
        yield visible_addresses(dht)[0], set_at
    finally:
        roster.stop()
        dht.shutdown()


def test_status_lists_the_live_workers_of_a_run_and_refuses_a_wrong_run_id_in_one_line(live_worker, diloco_cli):
    address, set_at = live_worker
    done = diloco_cli("status", "--peers", address, "--run-id", "trial")
    read_within_s = time.time() - set_at
    assert done.returncode == 0, done.stdout[-3000:]
    assert "run 'trial': 1 live worker, round 3, val_loss 2.6100" in done.stdout
    row = next(line.split() for line in done.stdout.splitlines() if line.strip().startswith("1 "))
    assert row[:6] == ["1", "3", "61", "1234", "2.5000", "2.6100"] and row[-2:] == ["s", "ago"], row
    assert row[6:8] == ["matchmaking", "for"], row
    minutes, seconds = row[8].split(":")
    assert 75 <= 60 * int(minutes) + int(seconds) <= 75 + read_within_s + 1, row  # 75 s and what reading took

    wrong = diloco_cli("status", "--peers", address, "--run-id", "other", "--timeout", "2")
    assert wrong.returncode == 2 and "Traceback" not in wrong.stdout
    assert "diloco: error: no live worker of run 'other' answered" in wrong.stdout
