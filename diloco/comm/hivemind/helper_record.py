"""How workers know the run's helpers: public peers that reduce parts of each round's vector and
contribute nothing (``diloco helper``, ``helper.py``).

Each helper keeps a record fresh under ``<run_id>.helpers`` (subkey: its peer id), as workers do
in the roster (``roster.py``): it lives ``TTL_HEARTBEATS`` heartbeats unless refreshed, and a helper that
stops cleanly says so at once. Workers count the live helpers into the group a round waits for,
and a run whose workers are all clients averages through them. In a round's group a helper
declares ``HELPER`` and workers leave it out of the round's contributors; a peer that declares it
and sends all the same declared no norm, and every peer's screening drops it (``robust.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from diloco.comm.hivemind.roster import HEARTBEAT_S, TTL_HEARTBEATS

logger = logging.getLogger(__name__)


HELPER = "helper"  # what a helper declares in a round's group: it reduces and contributes nothing


def contributors(gathered: dict) -> dict:
    """What the peers of a group that contribute declared: all but the helpers."""
    return {peer: data for peer, data in gathered.items() if not (isinstance(data, dict) and data.get(HELPER))}


def helpers_key(run_id: str) -> str:
    return f"{run_id}.helpers"


class HelperRecord:
    """A helper's heartbeat: its peer id and addresses under the run's helpers key, refreshed every
    ``heartbeat_s`` from a thread of its own. ``dht_call(fn)`` as in ``roster.Roster``."""

    def __init__(
        self, dht_call, *, run_id: str, peer_id: str, addresses: Sequence[str], heartbeat_s: float = HEARTBEAT_S
    ):
        self._dht_call, self.key = dht_call, helpers_key(run_id)
        self.peer_id, self.addresses = peer_id, list(addresses)
        self.heartbeat_s, self.ttl_s = heartbeat_s, TTL_HEARTBEATS * heartbeat_s
        self._leaving = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._publish()
        self._thread = threading.Thread(target=self._beat, name="diloco-helper-record", daemon=True)
        self._thread.start()

    def leave(self) -> None:
        """Tell the workers at once that this helper is gone, so that no round waits for it."""
        self._leaving = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s * 2)
        self._publish()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._publish()

    def _publish(self) -> None:
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        value = {"at": now, "leaving": self._leaving, "addrs": self.addresses}
        try:
            self._dht_call(
                lambda dht: dht.store(
                    self.key, subkey=self.peer_id, value=value, expiration_time=now + self.ttl_s, return_future=True
                )
            )
        except Exception:  # a missed heartbeat is not an error; the next one may go through
            logger.debug("helper heartbeat failed", exc_info=True)


def live_helpers(dht_call, run_id: str) -> int:
    """How many helpers of run ``run_id`` have a fresh record and are not leaving; 0 when the DHT
    does not answer (a round then waits for the workers only)."""
    return len(live_helper_ids(dht_call, run_id))


def live_helper_ids(dht_call, run_id: str) -> list[str]:
    """The peer ids of the helpers of run ``run_id`` that have a fresh record and are not leaving;
    none when the DHT does not answer."""
    try:
        found = dht_call(lambda dht: dht.get(helpers_key(run_id), latest=True, return_future=True))
    except Exception:
        logger.debug("helpers read failed", exc_info=True)
        return []
    if found is None or not isinstance(found.value, dict):
        return []
    return [
        str(subkey)
        for subkey, item in found.value.items()
        if isinstance(getattr(item, "value", None), dict) and not item.value.get("leaving")
    ]


class RunHelpers:
    """The live helpers of run ``run_id``, read from the DHT (through ``dht_call``) each time they
    are asked about: how many (``count``: a round's group waits for them too) and their peer ids
    (``ids``: where a client uploads its state)."""

    def __init__(self, dht_call, run_id: str):
        self._dht_call, self.run_id = dht_call, run_id

    def count(self) -> int:
        return live_helpers(self._dht_call, self.run_id)

    def ids(self) -> list[str]:
        return live_helper_ids(self._dht_call, self.run_id)


class NoHelpers(RunHelpers):
    """A run no helper serves (a transport built without a DHT to read them from)."""

    def __init__(self) -> None:
        super().__init__(None, "")

    def count(self) -> int:
        return 0

    def ids(self) -> list[str]:
        return []
