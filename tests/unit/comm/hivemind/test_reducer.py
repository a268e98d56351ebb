"""The reducers of our share of the all-reduce (comm/hivemind/reducer.py): no network needed."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging.partition import TensorPartReducer

from diloco.comm import sketch
from diloco.comm.hivemind.exclusion import Exclusions
from diloco.comm.hivemind.reducer import ScreeningReducer, SenderlessEndingReducer, reducer_for
from diloco.comm.hivemind.screening import declared_round, screen_round
from diloco.comm.robust import Screening, ScreeningRules
from diloco.comm.verdicts import SketchHistory

REDUCERS = [SenderlessEndingReducer, functools.partial(ScreeningReducer, excluded=frozenset({7}))]


async def _senders_fail_after_the_first_part(reducer_type) -> bool:
    """Our share in 3 parts from 3 senders: sender 2 is ourselves, dropped up front (every peer refused
    our contribution); senders 0 and 1 send part 0, then fail (cut off, or they gave up on us). Returns
    whether the reducer says it is finished, which is what the dropped worker's round waits for."""
    reducer = reducer_type([torch.Size([4])] * 3, 3)
    reducer.on_sender_failed(2)
    await asyncio.gather(*(reducer.accumulate_part(s, 0, torch.ones(4)) for s in (0, 1)))
    reducer.on_sender_failed(0)
    reducer.on_sender_failed(1)
    try:
        await asyncio.wait_for(reducer.finished.wait(), timeout=1.0)
    except TimeoutError:
        return False
    return True


@pytest.mark.timeout(30)
def test_a_reducer_whose_senders_all_failed_is_finished_at_once():
    # hivemind's own reducer never finishes here: the dropped worker's round then waited for the
    # all-reduce's whole timeout (comm.deadline_s) after the others had gone on
    assert not asyncio.run(_senders_fail_after_the_first_part(TensorPartReducer))
    for reducer_type in REDUCERS:
        assert asyncio.run(_senders_fail_after_the_first_part(reducer_type))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("reducer_type", REDUCERS)
def test_a_reducer_with_a_sender_left_still_waits_for_it(reducer_type):
    async def one_left() -> bool:
        reducer = reducer_type([torch.Size([4])] * 2, 2)
        reducer.on_sender_failed(1)
        assert not reducer.finished.is_set()
        averaged = await reducer.accumulate_part(0, 0, torch.full((4,), 3.0))
        assert torch.equal(averaged, torch.full((4,), 3.0)) and not reducer.finished.is_set()
        await reducer.accumulate_part(0, 1, torch.ones(4))
        return reducer.finished.is_set()

    assert asyncio.run(one_left())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("reducer_type", REDUCERS)
def test_the_reducer_counts_the_contributions_of_each_part(reducer_type):
    # what the senders' round records report: a part averaged without some sender is of fewer workers
    async def one_fails_after_the_first_part() -> dict[int, int]:
        reducer = reducer_type([torch.Size([4])] * 2, 3)
        await asyncio.gather(*(reducer.accumulate_part(s, 0, torch.ones(4)) for s in range(3)))
        reducer.on_sender_failed(2)
        await asyncio.gather(*(reducer.accumulate_part(s, 1, torch.ones(4)) for s in range(2)))
        return reducer.contributions

    assert asyncio.run(one_fails_after_the_first_part()) == {0: 3, 1: 2}


def test_only_a_peer_whose_tally_excludes_a_sender_holds_its_parts():
    async def types() -> list[type]:
        shapes = [torch.Size([4])]
        return [type(reducer_for(shapes, 2)), type(reducer_for(shapes, 2, excluded=frozenset({1})))]

    assert asyncio.run(types()) == [SenderlessEndingReducer, ScreeningReducer]


@pytest.mark.timeout(30)
def test_each_part_names_the_senders_kept_in_it_which_a_codec_that_gathers_takes_its_mean_of():
    async def reduced() -> ScreeningReducer:
        reducer = reducer_for([torch.Size([4])] * 2, 4, excluded=frozenset({3}))
        for part in range(2):
            await asyncio.gather(*(reducer.accumulate_part(s, part, torch.ones(4)) for s in range(4)))
        return reducer

    reducer = asyncio.run(reduced())
    assert [reducer.kept_in(part) for part in range(2)] == [frozenset({0, 1, 2})] * 2

    async def every_sender() -> frozenset | None:  # hivemind's reducer needs an event loop
        return SenderlessEndingReducer([torch.Size([4])], 2).kept_in(0)

    assert asyncio.run(every_sender()) is None  # every sender counts


class _Peer(str):
    """A peer id as the averager holds it (``str()`` of it is what the standings are keyed by)."""


def _runner(reducer, payload_dropped=None) -> SimpleNamespace:
    """What ``Exclusions.record`` reads of a finished all-reduce (a fake: the logic only)."""
    return SimpleNamespace(tensor_part_reducer=reducer, payload_dropped=payload_dropped or {})


@pytest.mark.timeout(30)
def test_every_peer_that_dropped_a_senders_sketch_excludes_it_after_exclude_after_rounds_but_never_itself():
    peers = [_Peer(f"peer{i}") for i in range(4)]
    screening = Screening(dropped={peers[3]: "it does not point the others' way"})  # the same on every peer
    exclusions, attacker = Exclusions(exclude_after=2), Exclusions(exclude_after=2)
    for _ in range(2):
        assert exclusions.of(peers, own=peers[0]) == set()
        exclusions.record(peers, screening, set(), _runner(None), own=peers[0])
        attacker.record(peers, screening, set(), _runner(None), own=peers[3])
    assert exclusions.of(peers, own=peers[0]) == {"peer3"}
    assert exclusions.excluded_peers() == {"peer3"}  # what the worker's records are told
    assert attacker.of(peers, own=peers[3]) == set()  # a peer never refuses its own parts
    screened = Exclusions.screened(Screening(scales=dict.fromkeys(peers, 1.0)), {peers[3]})
    assert screened.excluded == {peers[3]} and screened.dropped == {}  # left out of sums, not refused


@pytest.mark.timeout(30)
def test_an_excluded_sender_is_left_out_of_every_part_and_still_gets_the_others_average():
    async def reduce() -> list[torch.Tensor]:
        reducer = reducer_for([torch.Size([4])], 3, excluded=frozenset({2}))
        values = [torch.full((4,), 1.0), torch.full((4,), 3.0), torch.full((4,), 100.0)]
        averages = await asyncio.gather(*(reducer.accumulate_part(s, 0, values[s]) for s in range(3)))
        assert reducer.contributions == {0: 2}
        return averages

    averages = asyncio.run(reduce())
    assert all(torch.equal(a, torch.full((4,), 2.0)) for a in averages)  # the excluded sender's too


def test_norm_drops_and_unusable_payloads_count_as_left_out_even_without_a_reducer_of_ours():
    peers = [_Peer(f"peer{i}") for i in range(4)]
    exclusions = Exclusions(exclude_after=1)  # a client: no reducer of ours
    dropped = Screening(dropped={peers[1]: "far above the median"})
    exclusions.record(peers, dropped, set(), _runner(None, {peers[2]: "not finite"}), own=peers[0])
    assert exclusions.of(peers, own=peers[0]) == {"peer1", "peer2"}


def test_the_standings_outlive_the_process_and_a_restarted_worker_keeps_excluding(tmp_path, caplog):
    peers = [_Peer(f"peer{i}") for i in range(4)]
    path = tmp_path / "worker-0" / "standings.json"
    exclusions = Exclusions(exclude_after=2, path=path)
    for _ in range(2):
        exclusions.record(
            peers, Screening(dropped={peers[3]: "far above the median"}), set(), _runner(None), own=peers[0]
        )
    restarted = Exclusions(exclude_after=2, path=path)  # the worker's next process
    assert restarted.of(peers, own=peers[0]) == {"peer3"} and restarted.excluded_peers() == {"peer3"}
    assert restarted.scores.standings["peer peer1"].kept == 2
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert Exclusions(exclude_after=2, path=path).of(peers, own=peers[0]) == set()  # a new tally
    assert "could not read the standings" in caplog.text


def test_a_readmitted_peer_is_no_longer_excluded_in_the_workers_process():
    peers = [_Peer(f"peer{i}") for i in range(4)]
    exclusions = Exclusions(exclude_after=1, readmit_after=2)
    flipped = Screening(dropped={peers[3]: "against the others"})
    exclusions.record(peers, flipped, set(), _runner(None), own=peers[0])
    assert exclusions.excluded_peers() == {"peer3"}
    for _ in range(2):  # its term: rounds it sent in while excluded
        excluded = exclusions.of(peers, own=peers[0])
        exclusions.record(peers, Exclusions.screened(Screening(), excluded), excluded, _runner(None), own=peers[0])
    assert exclusions.of(peers, own=peers[0]) == set() and exclusions.excluded_peers() == set()


def test_an_exclusion_in_standings_written_before_readmission_existed_serves_the_first_term(tmp_path):
    peers = [_Peer(f"peer{i}") for i in range(4)]
    path = tmp_path / "standings.json"
    old = {"kept": 0, "clipped": 0, "left_out": 3, "in_a_row": 3, "excluded": "left out of 3 rounds in a row"}
    path.write_text(json.dumps({"peer peer3": old}))
    exclusions = Exclusions(exclude_after=3, path=path, readmit_after=2)
    assert exclusions.excluded_peers() == {"peer3"}
    for _ in range(2):
        excluded = exclusions.of(peers, own=peers[0])
        exclusions.record(peers, Exclusions.screened(Screening(), excluded), excluded, _runner(None), own=peers[0])
    assert exclusions.excluded_peers() == set() and exclusions.scores.standings["peer peer3"].exclusions == 1


def test_a_helper_judges_the_round_the_contributors_declared_and_its_reducer_leaves_a_replay_out():
    peers = [_Peer(f"peer{i}") for i in range(4)]
    helper = _Peer("helper")
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(5000, generator=generator)
    rounds = [[common + torch.randn(5000, generator=generator) for _ in peers] for _ in range(2)]

    def declared(r: int, vectors) -> dict:
        return {
            p: {"weight": 1.0, "norm": float(v.norm()), "round": [r, 0], "sketch": sketch.encode(sketch.sketch_of([v]))}
            for p, v in zip(peers, vectors)
        }

    assert declared_round(declared(7, rounds[0]), own=helper) == (7, 0)  # a helper declares nothing itself
    rules, history, exclusions = ScreeningRules(min_cosine=0.0), SketchHistory(), Exclusions(exclude_after=2)
    screen_round(declared(0, rounds[0]), rules, exclusions, own=helper, history=history)
    _, screening, excluded = screen_round(
        declared(1, [*rounds[1][:3], rounds[0][3]]), rules, exclusions, own=helper, history=history
    )
    assert screening.dropped == {} and list(screening.repeated) == [peers[3]]
    assert screening.excluded == {peers[3]} and excluded == set()  # left out of our sums; not a tally term
