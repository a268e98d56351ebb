"""The parts of the exact averager that need no network: its reducer of our share."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.partition import TensorPartReducer

from diloco.comm.hivemind.averager import SenderlessEndingReducer


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
    assert asyncio.run(_senders_fail_after_the_first_part(SenderlessEndingReducer))


@pytest.mark.timeout(30)
def test_a_reducer_with_a_sender_left_still_waits_for_it():
    async def one_left() -> bool:
        reducer = SenderlessEndingReducer([torch.Size([4])] * 2, 2)
        reducer.on_sender_failed(1)
        assert not reducer.finished.is_set()
        averaged = await reducer.accumulate_part(0, 0, torch.full((4,), 3.0))
        assert torch.equal(averaged, torch.full((4,), 3.0)) and not reducer.finished.is_set()
        await reducer.accumulate_part(0, 1, torch.ones(4))
        return reducer.finished.is_set()

    assert asyncio.run(one_left())


@pytest.mark.timeout(30)
def test_the_reducer_counts_the_contributions_of_each_part():
    # what the senders' round records report: a part averaged without some sender is of fewer workers
    async def one_fails_after_the_first_part() -> dict[int, int]:
        reducer = SenderlessEndingReducer([torch.Size([4])] * 2, 3)
        await asyncio.gather(*(reducer.accumulate_part(s, 0, torch.ones(4)) for s in range(3)))
        reducer.on_sender_failed(2)
        await asyncio.gather(*(reducer.accumulate_part(s, 1, torch.ones(4)) for s in range(2)))
        return reducer.contributions

    assert asyncio.run(one_fails_after_the_first_part()) == {0: 3, 1: 2}
