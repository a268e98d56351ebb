"""How the ranks of a sharded site agree (logic only, with the site's collective played by a
stand-in; tests/integration/test_site.py runs real torchrun sites)."""

from __future__ import annotations

from diloco.comm.base import PeerState, StateRank
from diloco.comm.sites import ShardedSiteStates


class _Site:
    """Every rank's value of a collective ``gather``, as the site would hand it back."""

    def __init__(self, values: list):
        self.values = values

    def gather(self, value) -> list:
        return self.values


def _states(fingerprints: list[float]) -> ShardedSiteStates:
    return ShardedSiteStates(_Site(fingerprints), inner=None)


def test_every_shard_of_a_site_ranks_with_one_fingerprint_made_from_all_of_them():
    """Groups of one size are told apart by the fingerprint: every shard of a site must use the
    same one, or shard 0 could pick one group's state and shard 1 the other's."""
    ranked = _states([0.9, 0.1]).site_rank(StateRank(2, 0.9))  # rank 0's view
    assert ranked == _states([0.9, 0.1]).site_rank(StateRank(2, 0.1))  # rank 1's
    assert ranked.peers == 2 and 0.0 <= ranked.fingerprint < 1.0 and ranked.fingerprint not in (0.9, 0.1)
    assert ranked != _states([0.1, 0.9]).site_rank(StateRank(2, 0.1))  # another site's shards


def test_a_rank_that_is_already_the_sites_or_none_is_kept():
    assert _states([0.0, 0.0]).site_rank(StateRank(4)) == StateRank(4)  # a round everyone averaged in
    assert _states([0.4, 0.4]).site_rank(StateRank(2, 0.4)) == StateRank(2, 0.4)  # a peer site's, taken


class _Transport:
    """This rank's shard transport's state exchange: it found ``found`` (a PeerState, or None)."""

    def __init__(self, found):
        self.found = found

    def fetch_state(self, round_index, *, better_than, timeout_s, newer=False, check=None):
        return self.found


def test_a_state_is_taken_only_when_every_shard_found_the_same_sites_state():
    """Shard 0 and shard 1 could each download the first offer they see: of one round, but from two
    groups. Taking them would make a model nobody else holds: the site takes neither."""
    group_a, group_b = StateRank(2, 0.25), StateRank(2, 0.75)
    found = PeerState(3, group_a, {"global_params": []})

    def fetch(answers: list) -> PeerState | None:
        states = ShardedSiteStates(_Site(answers), inner=_Transport(found))
        states.site_rank = lambda rank: rank  # this test is about the answers, not the ranks
        return states.fetch_state(3, better_than=StateRank(1), timeout_s=1.0)

    assert fetch([(3, group_a), (3, group_a)]) is found
    assert fetch([(3, group_a), (3, group_b)]) is None  # one round, two groups
    assert fetch([(3, group_a), (4, group_a)]) is None  # two rounds
    assert fetch([(3, group_a), None]) is None  # one shard found nothing
