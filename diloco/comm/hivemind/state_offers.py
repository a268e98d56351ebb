"""The states a run's peers offer, as the DHT carries them: each peer's (round, rank) packed into
the one float hivemind declares as a download priority (it serves the highest first)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from hivemind.p2p import PeerID

from diloco.comm.base import StateRank

logger = logging.getLogger(__name__)

Offer = tuple[int, StateRank]  # the round a state is after, and how it ranks


def priority(round_index: int, rank: StateRank) -> float:
    """A state's download priority: round, then peers, then fingerprint, packed into one float
    (exact: fewer than 53 bits in all)."""
    return round_index * 1000.0 + rank.peers + round(rank.fingerprint * (1 << 24)) / (1 << 24) * 0.99


def offer_of(priority_: float) -> Offer:
    """The (round, rank) that ``priority`` packed."""
    round_index, rest = divmod(priority_, 1000.0)
    peers = int(rest)
    return int(round_index), StateRank(peers, round((rest - peers) / 0.99 * (1 << 24)) / (1 << 24))


def same_offer(a: Offer, b: Offer) -> bool:
    """Whether two (round, rank) are one offer as the DHT carries it (the fingerprint to 24 bits)."""
    return priority(*a) == priority(*b)


class StateOffers:
    """Reads the offers of the run's other peers: ``call(fn)`` is a bounded DHT request
    (``peer.bounded_dht_call``), ``key`` the averagers' declarations, ``own_id`` our peer's id."""

    def __init__(self, call: Callable, key: str, own_id: bytes):
        self._call, self._key, self._own_id = call, key, own_id

    def read(self, exclude: Collection[str] = (), only: Collection[str] | None = None) -> list[Offer]:
        """(round, rank) of the state each other live peer offers, but those of the peers in
        ``exclude`` (ids in base58); with ``only``, those of the peers in it alone (a peer gone
        without leaving leaves its offer in the DHT until it expires); empty when the DHT did not
        answer."""
        try:
            entry = self._call(lambda dht: dht.get(self._key, latest=True, return_future=True))
        except TimeoutError as error:  # no offers seen this time; the callers ask again or give up at their bound
            logger.warning("reading the peers' state offers: %s", error)
            return []
        if entry is None or not isinstance(entry.value, dict):
            return []
        offers = []
        for subkey, declared in entry.value.items():
            if subkey == self._own_id or (exclude and _base58(subkey) in exclude):
                continue
            if only is not None and _base58(subkey) not in only:
                continue
            value = getattr(declared, "value", None)
            if isinstance(value, int | float) and value > 0:
                offers.append(offer_of(value))
        return offers

    def averaged_in_a_group(self, round_index: int) -> bool:
        """Whether a peer offers its state after this round, averaged in a group."""
        return any(r == round_index and rank.peers > 1 for r, rank in self.read())


def _base58(subkey: object) -> str:
    """A declaration's subkey (a peer id's bytes) as the peer's id in base58; "" if it is not one."""
    try:
        return PeerID(subkey).to_base58()
    except Exception:  # whatever a peer put there, it is no peer id
        return ""
