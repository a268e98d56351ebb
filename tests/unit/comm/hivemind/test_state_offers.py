"""How a hivemind worker reads its peers' state offers after a round and chooses one to take
(logic only: the DHT, the roster and the download are stand-ins handed to the real state exchange;
tests/integration/test_volunteer.py runs the real thing)."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import PeerID

from diloco.comm.base import StateRank
from diloco.comm.hivemind import state_exchange
from diloco.comm.hivemind.roster import PartialRead, live_counts
from diloco.comm.hivemind.roster_records import RosterEntry
from diloco.comm.hivemind.state_exchange import HivemindStateExchange
from diloco.comm.hivemind.state_offers import StateOffers, offer_of, priority


@pytest.fixture(autouse=True)
def _read_often(monkeypatch):
    """The scripted peers change per read, not per second: the exchange reads them again at once."""
    monkeypatch.setattr(state_exchange, "_READ_AGAIN_S", 0.01)


class _Averager:
    """Serves one state: the best peer's, after round 0."""

    def __init__(self, state: dict, round_index: int, rank: StateRank):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self.served = ({"round": round_index, "peers": rank.peers, "fingerprint": rank.fingerprint}, buffer)

    def load_state_from_peers(self, timeout, exclude=()):
        metadata, buffer = self.served
        return metadata, [torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)]


class _Roster:
    """``live`` workers, this one (index 0) among them, each serving its state; ``reads`` counts
    the reads."""

    worker_index = 0

    def __init__(self, live: int):
        self.live, self.reads = live, 0

    def own_entries(self):
        self.reads += 1
        return {i: RosterEntry(i, 0, 0) for i in range(self.live)}


class _UnreadRoster:
    worker_index = 0

    def own_entries(self):  # the DHT did not answer
        raise TimeoutError("the DHT did not answer within 3 s")


class _Offers:
    """The offers read over time: one reading a call, the last one again after that."""

    def __init__(self, readings: list[list[tuple[int, StateRank]]]):
        self._readings, self.latest = iter(readings), readings[-1] if readings else []

    def read(self, exclude=()):
        self.latest = next(self._readings, self.latest)
        return list(self.latest)


def _exchange(offers, live: int, *, server=None, client_mode: bool = False, roster=None) -> HivemindStateExchange:
    offers = offers if isinstance(offers, _Offers) else _Offers(offers)
    return HivemindStateExchange(
        server=server or _Averager({"global_params": [torch.ones(1)]}, 0, StateRank(2, 0.5)),
        offers=offers,
        roster=roster or _Roster(live),
        num_workers=live,
        client_mode=client_mode,
        linger_s=0.0,
    )


def _serving_the_best(
    offers_over_time: list[list[tuple[int, StateRank]]], live: int, **kwargs
) -> HivemindStateExchange:
    """A state exchange whose download serves, as hivemind does, the highest priority offered at the time."""
    offers = _Offers(offers_over_time)

    class _ServesTheBest:
        def load_state_from_peers(self, timeout, exclude=()):
            round_index, rank = max(offers.latest)
            served = _Averager({"global_params": [torch.full((1,), rank.fingerprint)]}, round_index, rank)
            return served.load_state_from_peers(timeout)

    return _exchange(offers, live, server=_ServesTheBest(), **kwargs)


def test_priority_packs_round_and_rank_exactly():
    rank = StateRank(3, 0.25)
    assert offer_of(priority(12, rank)) == (12, rank)


def test_a_peer_still_in_its_outer_step_is_waited_for_not_taken_as_absent():
    """Round 0 failed for us. The first reading shows only the dropped peers' offers (peers 0);
    the peer that averaged in a group of 2 has not offered its state yet. Concluding "nobody did
    better" then would leave our params apart from that peer's: wait for every live peer."""
    dropped = [(0, StateRank(0, 0.1)), (0, StateRank(0, 0.2))]
    states = _exchange([dropped, dropped, [*dropped, (0, StateRank(2, 0.5))]], live=4)
    found = states.fetch_state(0, better_than=StateRank(1, 0.3), timeout_s=5.0)
    assert found is not None and found.round == 0 and found.rank == StateRank(2, 0.5)
    torch.testing.assert_close(found.state["global_params"][0], torch.ones(1))


def test_when_every_live_peer_offers_this_round_and_none_ranks_higher_nobody_is_asked():
    states = _exchange([[(0, StateRank(0, 0.1)), (0, StateRank(1, 0.2))]], live=3)
    assert states.fetch_state(0, better_than=StateRank(1, 0.3), timeout_s=5.0) is None


def test_only_live_peers_that_serve_state_are_waited_for():
    class _Roster:
        worker_index = 0

        def own_entries(self):
            return {
                0: RosterEntry(0, 3, 60),  # this worker
                1: RosterEntry(1, 3, 60),
                2: RosterEntry(2, 3, 60, serves_state=False),  # client mode: offers nothing, ever
                3: RosterEntry(3, 2, 40, leaving=True),
            }

    assert live_counts(_Roster()) == (1, 3)

    class _PartialRoster:
        worker_index = 0

        def own_entries(self):  # a lookup that did not find this worker's own record
            raise PartialRead("the roster read did not find this worker's own record")

    assert live_counts(_PartialRoster()) is None  # unknown, not nobody: a client does not give up on its round


def test_an_unsynced_peers_state_is_not_taken_while_a_peer_that_averaged_may_still_offer_one():
    """The end of a streaming run: our average failed (we rank peers 0) and so did a dropped
    peer's, whose fingerprint happens to rank above ours. The peer that averaged is still in its
    outer step (its offer is of an earlier round). Taking the dropped peer's state then, as the
    best offered so far, would end us on neither side's params: wait for the one that averaged."""
    dropped, averaged = (5, StateRank(0, 0.9)), (5, StateRank(2, 0.5))
    states = _serving_the_best([[dropped, (3, StateRank(0))], [dropped, (3, StateRank(0))], [dropped, averaged]], 3)
    found = states.fetch_state(5, better_than=StateRank(0, 0.3), timeout_s=10.0, newer=True)
    assert found is not None and found.rank == StateRank(2, 0.5), found


def test_once_every_live_peer_offers_this_round_an_unsynced_state_above_ours_is_taken():
    """Two sides cut off from each other, each alone (peers 0): one takes the other's state."""
    served = _Averager({"global_params": [torch.ones(1)]}, 0, StateRank(0, 0.5))
    states = _exchange([[(0, StateRank(0, 0.5))]], live=2, server=served)
    found = states.fetch_state(0, better_than=StateRank(0, 0.3), timeout_s=5.0)
    assert found is not None and found.rank == StateRank(0, 0.5)


def _client(offers, served: tuple[int, StateRank], live: int) -> HivemindStateExchange:
    server = _Averager({"global_params": [torch.ones(1)]}, *served)
    return _exchange(offers if isinstance(offers, _Offers) else [offers], live=live, server=server, client_mode=True)


def test_a_client_whose_params_no_serving_peer_holds_takes_a_served_state_of_its_own_size():
    """Every worker's round failed (each applied its own pseudo-gradient: unsynced, peers 0). The
    public worker's fingerprint ranks below a NAT'd client's: by fingerprint alone the client keeps
    its params and the public worker waits for a state nobody can serve (a client serves none),
    and they stay apart for the rest of the run. The client takes the served state instead."""
    public = (1, StateRank(0, 0.2))
    found = _client([public], public, live=2).fetch_state(1, better_than=StateRank(0, 0.7), timeout_s=5.0)
    assert found is not None and found.rank == StateRank(0, 0.2)


def test_a_client_whose_params_a_serving_peer_holds_ranks_them_by_fingerprint_as_that_peer_does():
    """A split round: our group's serving peer offers our very state (same size, same fingerprint)
    and outranks the other group's: nothing to take, as that peer concludes too."""
    ours, other = (1, StateRank(2, 0.7)), (1, StateRank(2, 0.2))
    states = _client([ours, other], other, live=3)
    assert states.fetch_state(1, better_than=StateRank(2, 0.7), timeout_s=5.0) is None


def test_a_client_waits_for_its_own_groups_serving_peer_before_taking_another_groups_state():
    """A split round of two groups of one size. Our group's serving peer still offers its previous
    round (its new offer is not on the DHT yet); the other group's already offers this one, below
    our fingerprint. Lowering our rank then would take the other group's params, which its own
    peers drop a moment later for ours: wait until every serving peer has offered."""
    ours, other = (1, StateRank(2, 0.7)), (1, StateRank(2, 0.2))
    readings = _Offers([[(0, StateRank(2, 0.9)), other], [(0, StateRank(2, 0.9)), other], [ours, other]])
    states = _client(readings, other, live=3)
    assert states.fetch_state(1, better_than=StateRank(2, 0.7), timeout_s=5.0) is None


def test_a_state_that_wins_only_by_its_fingerprint_is_taken_once_every_live_peer_has_offered():
    """Every worker's round failed (three serving peers, each alone: peers 1). The one ranked
    highest has not offered yet: taking the middle one's state would strand us on params that
    the middle one itself drops for the highest's."""
    middle, highest = (2, StateRank(1, 0.5)), (2, StateRank(1, 0.9))
    states = _serving_the_best([[middle], [middle], [middle, highest]], live=3)
    found = states.fetch_state(2, better_than=StateRank(1, 0.1), timeout_s=5.0)
    assert found is not None and found.rank == StateRank(1, 0.9)


def test_an_unread_roster_is_not_taken_for_every_peer_having_offered():
    served = _Averager({"global_params": [torch.ones(1)]}, 0, StateRank(0, 0.5))
    states = _exchange([[(0, StateRank(0, 0.5))]], live=2, server=served, roster=_UnreadRoster())
    assert states.fetch_state(0, better_than=StateRank(0, 0.3), timeout_s=1.0) is None


def test_a_bigger_groups_state_is_taken_at_once_only_when_no_other_group_can_match_it():
    """Five workers, a round split three ways (2 + 2 + us alone). The first group of two offers
    before the second, whose fingerprint ranks higher: taking the first at once would strand us
    on params that its own peers drop for the second's. A group of three of five is taken at once."""
    first, second = (4, StateRank(2, 0.3)), (4, StateRank(2, 0.8))
    states = _serving_the_best([[first] * 2, [first] * 2, [first] * 2 + [second] * 2], live=5)
    found = states.fetch_state(4, better_than=StateRank(1, 0.5), timeout_s=5.0)
    assert found is not None and found.rank == StateRank(2, 0.8), found
    majority = (4, StateRank(3, 0.1))
    states = _serving_the_best([[majority] * 3], live=5)
    found = states.fetch_state(4, better_than=StateRank(1, 0.5), timeout_s=5.0)
    assert found is not None and found.rank == StateRank(3, 0.1), found


def test_a_bigger_groups_state_is_taken_at_once_when_the_workers_left_cannot_match_it():
    """Four workers split 2 + 1 + us alone; the other one alone is still in its inner steps (no offer
    yet). It cannot make a group of two on its own: the pair's state is taken at once, not after it."""
    pair = (3, StateRank(2, 0.4))
    roster = _Roster(live=4)
    states = _serving_the_best([[pair, pair]], live=4, roster=roster)
    found = states.fetch_state(3, better_than=StateRank(1, 0.9), timeout_s=5.0)
    assert found is not None and found.rank == StateRank(2, 0.4) and roster.reads == 1, found


def test_a_live_peer_that_never_offers_is_waited_for_half_the_time_then_taken_for_a_straggler():
    """Three workers, each drifted alone (peers 1); one is stuck in a sync of its own and offers
    nothing. Waiting for it the whole time would leave the other two apart: after half of it the
    higher fingerprint present wins, which the other concludes too."""
    other = (2, StateRank(1, 0.9))
    states = _serving_the_best([[other]], live=3)
    started = time.monotonic()
    found = states.fetch_state(2, better_than=StateRank(1, 0.4), timeout_s=4.0)
    assert found is not None and found.rank == StateRank(1, 0.9)
    assert 2.0 <= time.monotonic() - started < 3.5


def test_stale_offers_of_peers_gone_are_given_up_after_one_failed_download():
    gone = SimpleNamespace(load_state_from_peers=lambda timeout, exclude=(): None)  # the offer's peer is gone
    states = _exchange([[(3, StateRank(2, 0.5))]], live=1, server=gone)  # nobody else live; an offer left on the DHT
    started = time.monotonic()
    assert states.fetch_state(3, better_than=StateRank(0, 0.1), timeout_s=10.0) is None
    assert time.monotonic() - started < 2


_OURS, _KILLED, _RESTARTED = (
    PeerID.from_base58(text)
    for text in (
        "12D3KooWNhkSDCdeCiJdc2t8ck8sFkYnh4DgQ2hCkgx1dA4ymVXf",
        "12D3KooWEwUrpn8Dxd3kSP2PK2pGxronXW3DYsh8Le4i2eLvU1c5",
        "12D3KooWJQUNSUazB4Xv4biiJrMcanevs3B3BE2DYYj1J9NAKGe6",
    )
)


class _RestartedRoster:
    """Two live workers: this one and worker 1, restarted under a new peer id after it was killed."""

    worker_index, rounds_done = 0, 3

    def own_entries(self):
        return {
            0: RosterEntry(0, 3, 30, peer=_OURS.to_base58()),
            1: RosterEntry(1, 3, 30, peer=_RESTARTED.to_base58()),
        }


def _lingering_after(declared: dict, linger_s: float) -> HivemindStateExchange:
    """A worker that offers its state after round 2 (2 peers), the DHT holding the ``declared`` offers."""
    entry = SimpleNamespace(value={peer.to_bytes(): SimpleNamespace(value=p) for peer, p in declared.items()})
    states = HivemindStateExchange(
        server=SimpleNamespace(share_state=lambda *args, **kwargs: None),
        offers=StateOffers(lambda fn: entry, "run.all_averagers", _OURS.to_bytes()),
        roster=_RestartedRoster(),
        num_workers=2,
        client_mode=False,
        linger_s=linger_s,
    )
    states.publish_state(2, StateRank(2, 0.5), lambda: {})
    return states


def test_the_end_linger_waits_for_a_live_peer_behind_not_for_the_offer_a_killed_peer_left_behind():
    ours = priority(2, StateRank(2, 0.5))
    older = priority(1, StateRank(2, 0.5))
    started = time.monotonic()
    # the killed worker's offer of round 1 is still in the DHT; the restarted one offers what we do
    _lingering_after({_KILLED: older, _RESTARTED: ours}, linger_s=30.0).linger()
    assert time.monotonic() - started < 1.0
    # a live peer behind: it may be fetching our state, waited for up to the linger's bound
    started = time.monotonic()
    _lingering_after({_RESTARTED: older}, linger_s=1.0).linger()
    assert 1.0 <= time.monotonic() - started < 5.0
