"""A hivemind worker's state, offered to the run's peers and taken from them.

After each round a worker offers its state (``publish_state``): hivemind's averager serves it to
whoever asks, highest priority first (``state_offers.py``: round, then group size, then the
params' fingerprint). A worker whose round failed, was partial, or ran in a smaller group looks
for a better state of that round (``fetch_state``), and takes it only when no better one can still
come: see ``OfferReading`` for the rule. After its last round a worker stays a moment while a
peer may still need its state (``linger``). In a run of clients, where nobody serves a state, a
worker asks for one and a client that holds it uploads it to a helper, which offers it
(``state_relay.py``).
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass

import torch

from diloco.comm.base import PeerState, StateCheck, StateExchange, StateRank, StateReader, StateVerdict
from diloco.comm.hivemind.helper_record import NoHelpers, RunHelpers
from diloco.comm.hivemind.roster import live_counts, live_peer_ids
from diloco.comm.hivemind.state_download import SERVED_BY, SOURCES, STATE_BYTES
from diloco.comm.hivemind.state_offers import Offer, StateOffers, priority, same_offer
from diloco.comm.hivemind.state_relay import Published, StateWants, Wanted

logger = logging.getLogger(__name__)

_CHECK_AGAIN_S = 2.0  # a state that cannot be checked yet is downloaded again after this: the others declare theirs
_READ_AGAIN_S = 0.5  # how often a search for a better state, and the end linger, read the offers again


@dataclass
class OfferReading:
    """One look at the offers while a worker looks for a state after round ``round_index``: which
    offer, if any, it should take. ``others``: live peers besides us that serve a state (None: the
    roster was not read); ``workers``: who can be in a group; ``ours``: the rank to beat."""

    round_index: int
    offers: list[Offer]
    others: int | None
    workers: int
    ours: StateRank
    everyone_offered: bool  # every live peer that serves state has offered the round (or waited long enough)
    newer: bool  # any later round's state is wanted too

    def wanted(self, offered_round: int, rank: StateRank) -> bool:
        if self.newer and offered_round > self.round_index:
            return True
        if offered_round != self.round_index or not rank > self.ours:
            return False
        # a bigger group's state at once when no other group can match it any more; any other once
        # every live peer has offered the round: before, the peer that wins (a bigger group, or one
        # of ours by its fingerprint) may still be in its outer step, and what we took would be
        # params that its owner drops a moment later for the winner's
        return (rank.peers > self.ours.peers and self._unmatched(rank)) or self.everyone_offered

    def _unmatched(self, rank: StateRank) -> bool:
        # groups share no worker: besides that group and us, the workers not seen in a smaller one
        # this round are too few to make another of its size
        smaller = sum(1 for r, o in self.offers if r == self.round_index and o.peers < rank.peers)
        return self.workers - rank.peers - 1 - smaller < rank.peers

    @property
    def any_wanted(self) -> bool:
        return any(self.wanted(r, rank) for r, rank in self.offers)


class HivemindStateExchange(StateExchange):
    """``server`` is the averager that serves our state and downloads a peer's (hivemind's
    ``share_state`` / ``load_state_from_peers``); ``offers`` reads the others' offers; ``roster``
    tells who is live and serves state (``roster.py``); ``client_mode``: nobody can dial us, so we
    serve nothing; ``linger_s``: the most a worker stays after its last round for a peer behind.
    ``wants`` (clients) asks for a state when no peer serves one while ``helpers`` (the run's live
    helpers) says one can relay it."""

    def __init__(
        self,
        *,
        server,
        offers: StateOffers,
        roster,
        num_workers: int,
        client_mode: bool,
        linger_s: float,
        wants: StateWants | None = None,
        helpers: RunHelpers | None = None,
    ):
        self._server, self._offers, self._roster = server, offers, roster
        self.num_workers, self.client_mode, self.linger_s = num_workers, client_mode, linger_s
        self._wants, self._helpers = wants, helpers if helpers is not None else NoHelpers()
        self._offered: Published | None = None  # (round, rank, reader) of the state we offer

    @property
    def published(self) -> tuple[int, StateRank] | None:
        """(round, rank) of the state we offer."""
        return None if self._offered is None else self._offered[:2]

    def published_state(self) -> Published | None:
        """(round, rank, reader) of the state we offer (a client's too: a helper can relay it)."""
        return self._offered

    def publish_state(self, round_index: int, rank: StateRank, state: StateReader) -> None:
        self._offered = (round_index, rank, state)
        if self.client_mode:  # nobody can dial us to download it (hivemind refuses to share in client mode)
            return
        self._server.share_state(  # serialized only when a peer asks for it
            {"round": round_index, "peers": rank.peers, "fingerprint": rank.fingerprint},
            state,
            priority=priority(round_index, rank),
        )

    def fetch_state(
        self,
        round_index: int,
        *,
        better_than: StateRank,
        timeout_s: float,
        newer: bool = False,
        check: StateCheck | None = None,
    ) -> PeerState | None:
        try:
            return self._search(round_index, better_than, timeout_s=timeout_s, newer=newer, check=check)
        finally:
            if self._wants is not None:
                self._wants.withdraw()  # nothing to take back unless we asked

    def _search(
        self,
        round_index: int,
        better_than: StateRank,
        *,
        timeout_s: float,
        newer: bool,
        check: StateCheck | None,
    ) -> PeerState | None:
        deadline = time.monotonic() + timeout_s
        refused: set[str] = set()  # peers whose state ``check`` refused: not asked again in this search
        # a live peer that has not offered by half the time is a straggler (stuck in a sync of its
        # own), not one finishing its outer step: the offers there are then everyone's, and it
        # takes the winner's state itself when it comes
        patient_until = time.monotonic() + timeout_s / 2
        download_failed = False
        relayed: bool | None = None  # whether a helper can relay a state (read once, when nobody serves one)
        while time.monotonic() < deadline:
            reading = self._read(round_index, better_than, newer, patient_until=patient_until, refused=refused)
            if reading.others == 0 and relayed is None and self._wants is not None:
                # nobody but a helper can serve us (clients only): we ask, a client that holds it uploads it there
                relayed = self._helpers.count() > 0
            relay = bool(relayed) and reading.others == 0
            if reading.others == 0 and not relay and (not reading.offers or download_failed):
                return None  # nobody live can serve a state (clients only, alone, or what is offered is stale)
            if relay:
                self._wants.ask(Wanted(round_index, reading.ours, newer))
            if reading.any_wanted:
                # hivemind downloads from the highest priority first: the newest round, then the best rank
                found, pending = self._download(reading, max(1.0, deadline - time.monotonic()), check, refused)
                if found is not None:
                    return found
                download_failed = download_failed or not pending  # one that cannot be checked yet did not fail
            elif reading.everyone_offered and not relay:
                # none ranks above us. A peer still in its outer step has not offered this round
                # yet: wait for it rather than take the others' offers (a dropped peer's, say)
                return None
            # the others may still be finishing this round's outer step: ask again shortly
            time.sleep(min(_READ_AGAIN_S, max(0.0, deadline - time.monotonic())))
        return None

    def _read(
        self, round_index: int, better_than: StateRank, newer: bool, *, patient_until: float, refused: set[str]
    ) -> OfferReading:
        offers = self._offers.read(exclude=refused)  # a refused peer's offer is wanted no more
        live = live_counts(self._roster)
        others = None if live is None else live[0]
        # every live peer that serves state has offered this round (one still in its outer step
        # has not), or it was waited for long enough. Offers left by peers gone since are not
        # waited for; an unread roster (None) is not "everyone"
        everyone_offered = others is not None and (
            sum(r >= round_index for r, _ in offers) >= others or time.monotonic() > patient_until
        )
        ours = better_than
        if (
            self.client_mode
            and everyone_offered
            and not any(same_offer((r, rank), (round_index, better_than)) for r, rank in offers)
        ):
            # nobody can take our state (a client serves none) and no peer that serves holds it:
            # between states of one size, any served one wins over ours, or we stay apart
            ours = StateRank(better_than.peers, -1.0)
        workers = max(self.num_workers, 0 if live is None else live[1])  # who can be in a group
        return OfferReading(round_index, offers, others, workers, ours, everyone_offered, newer)

    def _download(
        self, reading: OfferReading, timeout_s: float, check: StateCheck | None, refused: set[str]
    ) -> tuple[PeerState | None, bool]:
        """The best state offered by a peer not in ``refused``, if it is still one ``reading`` wants
        once downloaded and ``check`` does not refuse it (its peer then joins ``refused``); and
        whether one was downloaded that ``check`` cannot tell yet (to be downloaded again)."""
        started = time.monotonic()
        found = self._download_best(timeout_s, refused)
        if found is None:
            return None, False
        metadata, payload = found
        offered_round = metadata.get("round", -1)
        rank = StateRank(metadata.get("peers", 0), metadata.get("fingerprint", 0.0))
        if not (reading.wanted(offered_round, rank) and payload):
            return None, False
        sources = metadata.get(SOURCES, [])
        logger.info(
            "downloaded the state of a peer after round %d: %d bytes in %.2f s%s",
            offered_round + 1,
            metadata[STATE_BYTES] if isinstance(payload, dict) else payload[0].numel(),
            time.monotonic() - started,
            f", in parts from {len(sources)} peers" if sources else "",
        )
        # in parts, the state itself; whole, hivemind's tensors: the bytes ``torch.save`` wrote
        state = (
            payload
            if isinstance(payload, dict)
            else torch.load(io.BytesIO(memoryview(payload[0].numpy())), weights_only=True)
        )
        peer = metadata.get(SERVED_BY, "")
        found = PeerState(offered_round, rank, state, served_by=peer)
        verdict = check(found) if check is not None else StateVerdict()
        if verdict.refuse:
            logger.warning("refused the state of peer %s after round %d: %s", peer, offered_round + 1, verdict.refuse)
            refused.update([peer, *sources])  # every peer that served it serves that state
        elif verdict.wait:
            logger.info("the state of peer %s after round %d cannot be checked yet: %s", peer, offered_round + 1,
                        verdict.wait)  # fmt: skip
            time.sleep(min(_CHECK_AGAIN_S, max(0.0, timeout_s - (time.monotonic() - started))))
        return (found if verdict.take else None), bool(verdict.wait)

    def _download_best(self, timeout_s: float, refused: set[str]):
        """The download of the best state offered by a peer not in ``refused`` (state_download.py),
        or None when it did not end within ``timeout_s``."""
        try:
            return self._server.load_state_from_peers(timeout=timeout_s, exclude=sorted(refused))
        except TimeoutError:  # concurrent.futures.TimeoutError is TimeoutError
            logger.warning("downloading a peer's state: no answer within %.0f s", timeout_s)
            return None

    def sole_state_source(self) -> bool:
        if self.client_mode:  # nobody can take our state
            return False
        try:
            return self._roster.serves_alone()
        except Exception:  # the DHT did not tell: someone may serve a state of their own
            logger.debug("roster read failed", exc_info=True)
            return False

    def linger(self) -> None:
        """After the last round nobody would serve a peer that lost part of it: stay while a live peer
        offers an older state or a worse one of that round (it may be fetching ours), or a live
        client has not finished our rounds, at most ``linger_s``. A client stays only where a helper
        can relay its state (a run where no live worker serves one): it uploads it when asked."""
        if self.published is None or (self.client_mode and not self._relays()):
            return
        last_round, rank = self.published
        deadline = time.monotonic() + self.linger_s
        while time.monotonic() < deadline and (self._live_offer_behind(last_round, rank) or self._clients_behind()):
            time.sleep(_READ_AGAIN_S)

    def _live_offer_behind(self, last_round: int, rank: StateRank) -> bool:
        """Whether a live peer offers an older state than ours, or a worse one of our last round: it
        may be fetching ours. The offer of a peer gone without leaving (killed, then restarted
        under a new peer id) stays in the DHT until it expires: it is nobody's, and not waited for."""
        live = live_peer_ids(self._roster)
        offers = self._offers.read() if live is None else self._offers.read(only=live)
        return any(r < last_round or (r == last_round and o < rank) for r, o in offers)

    def _relays(self) -> bool:
        """Whether a helper can relay our state, a client's, to a peer behind: no other live worker
        serves a state and a helper is live (state_relay.py)."""
        if self._wants is None:
            return False
        live = live_counts(self._roster)
        return live is not None and live[0] == 0 and self._helpers.count() > 0

    def _clients_behind(self) -> bool:
        """Whether a live client has not finished the rounds we have: it offers no state, so only its
        roster record tells, and after a lost part it can take a state only from a peer like us."""
        try:
            entries = self._roster.own_entries()
        except Exception:  # the DHT did not tell: wait for nobody in particular
            return False
        done = self._roster.rounds_done
        return any(
            i != self._roster.worker_index and not e.leaving and not e.serves_state and e.round < done
            for i, e in entries.items()
        )
