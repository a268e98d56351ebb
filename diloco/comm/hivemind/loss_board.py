"""The run's held-out losses on the DHT: the hivemind transport's ``LossBoard``.

Each worker stores what it evaluated under ``<run_id>.losses.<key>`` (subkey: its worker index) as
``[[batch, loss], ...]``; a read merges every worker's. Records expire after ``TTL_S``: long
enough for the workers of a round to read them, gone before they pile up. Offered only in runs of
trusted workers (``comm.trust=trusted``): elsewhere a peer could publish any loss.
"""

from __future__ import annotations

import logging

from diloco.comm.base import LossBoard

logger = logging.getLogger(__name__)

TTL_S = 120.0


class DHTLossBoard(LossBoard):
    """Held-out losses through ``dht_call`` (``peer.bounded_dht_call``), under run ``run_id``'s keys.
    ``wait_s``: how long a publication may take to reach the others (a DHT request's bound)."""

    def __init__(self, dht_call, *, run_id: str, wait_s: float):
        self._dht_call, self._prefix, self.wait_s = dht_call, f"{run_id}.losses.", wait_s

    def publish(self, key: str, worker: int, losses: dict[int, float]) -> None:
        from hivemind.utils import get_dht_time

        value = [[int(i), float(loss)] for i, loss in sorted(losses.items())]
        expiration = get_dht_time() + TTL_S
        try:
            self._dht_call(
                lambda dht: dht.store(
                    self._prefix + key, subkey=worker, value=value, expiration_time=expiration, return_future=True
                )
            )
        except Exception:  # the others evaluate what they do not find
            logger.debug("publishing held-out losses failed", exc_info=True)

    def read(self, key: str) -> dict[int, float]:
        try:
            found = self._dht_call(lambda dht: dht.get(self._prefix + key, latest=True, return_future=True))
        except Exception:
            logger.debug("reading held-out losses failed", exc_info=True)
            return {}
        losses: dict[int, float] = {}
        if found is not None and isinstance(found.value, dict):
            for item in found.value.values():
                for pair in getattr(item, "value", None) or ():
                    if isinstance(pair, (list, tuple)) and len(pair) == 2:
                        losses.setdefault(pair[0], pair[1])
        return losses
