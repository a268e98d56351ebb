"""In a keyed run (``comm.run_key``) the params a worker declared count only when its record is
signed with the run key: a peer without the key cannot put a digest in the run's roster, where a
worker checking a downloaded state would count it as a vote. Real DHT peers, one process each."""

from __future__ import annotations

import threading
import time

import pytest

from diloco.comm.hivemind.membership import HivemindMembership
from diloco.comm.hivemind.peer import bounded_dht_call, start_dht, visible_addresses
from diloco.comm.hivemind.roster import Roster
from diloco.comm.hivemind.settings import HivemindConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

KEY = "the-run-key"


def _worker(dht, index: int) -> HivemindMembership:
    call = bounded_dht_call(dht, threading.Lock(), timeout_s=10.0)
    roster = Roster(call, run_id="keyed", worker_index=index, planned=3, peer_id=f"P{index}")
    return HivemindMembership(roster, peer=None, num_workers=3)


def test_a_params_declaration_not_signed_with_the_run_key_is_ignored_in_a_keyed_run():
    hm = HivemindConfig(startup_timeout_s=120.0)
    started = [start_dht(hm, run_key=KEY, client_mode=False)]
    try:
        first = visible_addresses(started[0])
        for run_key in (KEY, "another-key"):
            started.append(start_dht(hm, run_key=run_key, initial_peers=first, client_mode=False))
        reader, keyed, outsider = (_worker(dht, index) for index, dht in enumerate(started))
        outsider.declare_params(3, "f" * 64, peers=3)  # a forged vote, signed with another key
        outsider.roster._publish()
        keyed.declare_params(3, "a" * 64, peers=3)
        keyed.roster._publish()
        deadline = time.monotonic() + 60
        while 1 not in (declared := reader.declared_params()) and time.monotonic() < deadline:
            time.sleep(0.5)  # the DHT may need a moment to find the record's holders
        assert declared.get(1) is not None and declared[1].digest == "a" * 16, declared
        assert 2 not in declared and 2 not in reader.live_workers(), declared
    finally:
        for dht in started:
            dht.shutdown()
