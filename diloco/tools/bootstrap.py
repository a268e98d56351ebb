"""``diloco bootstrap``: a DHT-only peer that workers join through. It prints its addresses, then,
until Ctrl-C or SIGTERM, dials back the workers that ask whether they are reachable (``comm/hivemind/
reachability.py``), once a second.
"""

from __future__ import annotations

import logging
import threading

from diloco.comm.hivemind import reachability
from diloco.comm.hivemind.peer import bounded_dht_call, start_dht, visible_addresses
from diloco.comm.hivemind.settings import HivemindConfig

logger = logging.getLogger(__name__)


def run_bootstrap(*, host: str, port: int) -> int:
    """Serve as the run's bootstrap peer on ``host:port`` until interrupted; the exit code."""
    dht = start_dht(HivemindConfig(host=host, port=port), initial_peers=[])
    try:
        for address in visible_addresses(dht):
            print(f"bootstrap peer up: comm.hivemind.initial_peers=['{address}']", flush=True)
        dht_call, answered, never = bounded_dht_call(dht, threading.Lock(), timeout_s=10.0), {}, threading.Event()
        while not never.wait(1.0):
            try:
                reachability.answer(dht_call, own_peer_id=str(dht.peer_id), answered=answered)
            except Exception:  # the DHT did not answer this time: the next second may
                logger.debug("dial-back round failed", exc_info=True)
    finally:
        dht.shutdown()
    return 0
