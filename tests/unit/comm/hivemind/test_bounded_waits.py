"""Every wait of the hivemind transport ends at its bound (comm/bounds.py) when the other side never
answers: a round stuck in matchmaking or in the all-reduce, a state download, the averager's
tensors and its group key. The parts that never answer are scripted; the code that waits is real."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from diloco.comm.base import StateRank
from diloco.comm.config import CommConfig
from diloco.comm.hivemind import group_round
from diloco.comm.hivemind.averager import ask_within, held_within
from diloco.comm.hivemind.group_round import LEFT_BEHIND, GroupRound
from diloco.comm.hivemind.roster_records import RosterEntry
from diloco.comm.hivemind.settings import HivemindConfig
from diloco.comm.hivemind.state_exchange import HivemindStateExchange
from diloco.comm.link_meter import CodecChoice
from diloco.compression import NoCompression

pytestmark = pytest.mark.timeout(60)


class _StuckControl:
    """hivemind's StepControl of a step that never ends, stuck before or inside the all-reduce."""

    def __init__(self, began_allreduce: bool):
        self.began_allreduce, self.cancelled = began_allreduce, False
        self._never = threading.Event()

    def result(self, timeout):
        self._never.wait(timeout)
        raise concurrent.futures.TimeoutError

    def cancel(self):
        self.cancelled = True


def _group_round(*, others_gone: bool = False) -> GroupRound:
    """One worker's attempts at a round, with nothing else in the run (``others_gone``: not even
    the other workers it had)."""
    return GroupRound(
        CommConfig(deadline_s=1.0, hivemind=HivemindConfig(request_timeout_s=0.2)),
        codecs=CodecChoice(NoCompression()),
        own_id="us",
        plane=None,
        roster=SimpleNamespace(model="", stage=lambda stage: None),
        offers=SimpleNamespace(averaged_in_a_group=lambda round_index: False),
        others=SimpleNamespace(others_gone=lambda: others_gone, others_done=lambda fragment, round_index: False),
        control_s=0.2,
    )


@pytest.mark.parametrize("began_allreduce", [False, True], ids=["matchmaking", "all-reduce"])
def test_a_round_that_hivemind_never_ends_stops_at_its_limit(began_allreduce):
    control = _StuckControl(began_allreduce)
    started = time.monotonic()
    stage = "the all-reduce" if began_allreduce else "matchmaking"
    with pytest.raises(TimeoutError, match=f"no result from the averager after 0 s in {stage}"):
        _group_round().await_step(control, 0, limit=started + 0.3, fragment=0)
    assert control.cancelled and time.monotonic() - started < 5


def test_a_round_stops_looking_for_a_group_once_every_other_worker_has_left(monkeypatch):
    monkeypatch.setattr(group_round, "_POLL_S", 0.1)  # looks at the others every 0.1 s, not every second
    control = _StuckControl(began_allreduce=False)
    with pytest.raises(TimeoutError, match="no other worker of the run is live"):
        _group_round(others_gone=True).await_step(control, 0, limit=time.monotonic() + 30, fragment=0)
    assert control.cancelled


def test_a_round_stops_looking_for_a_group_once_it_refused_one_that_counted_it_in_too_late(monkeypatch):
    monkeypatch.setattr(group_round, "_POLL_S", 0.1)
    control = _StuckControl(began_allreduce=False)
    with pytest.raises(TimeoutError, match=LEFT_BEHIND):
        _group_round().await_step(control, 0, limit=time.monotonic() + 30, fragment=0, left_behind=lambda: True)
    assert control.cancelled


def test_a_state_download_that_never_ends_gives_up_at_the_timeout():
    def load_state_from_peers(timeout, exclude=()):
        threading.Event().wait(timeout)  # hivemind's MPFuture.result(timeout) past its time
        raise concurrent.futures.TimeoutError

    class _Roster:  # this worker and one other, both serving their state
        worker_index = 0

        def own_entries(self):
            return {0: RosterEntry(0, 3, 60), 1: RosterEntry(1, 3, 60)}

    class _Offers:
        def read(self, exclude=()):
            return [(3, StateRank(2))]  # a peer offers round 3, averaged by 2

    states = HivemindStateExchange(
        server=SimpleNamespace(load_state_from_peers=load_state_from_peers),
        offers=_Offers(),
        roster=_Roster(),
        num_workers=2,
        client_mode=False,
        linger_s=0.0,
    )
    started = time.monotonic()
    assert states.fetch_state(3, better_than=StateRank(1), timeout_s=1.0) is None
    assert time.monotonic() - started < 5


def test_the_averagers_tensors_held_by_a_stuck_all_reduce_are_waited_for_at_most_the_bound():
    lock, tensors = mp.Lock(), [torch.zeros(2)]
    lock.acquire()  # what the averager's process does through an all-reduce
    started = time.monotonic()
    with (
        pytest.raises(TimeoutError, match="the averager held its tensors for more than 0 s"),
        held_within(lock, tensors, 0.3),
    ):
        pass
    assert time.monotonic() - started < 5
    lock.release()
    with held_within(lock, tensors, 0.3) as held:
        assert held[0].shape == (2,)


def test_a_group_key_the_averagers_process_never_takes_fails_at_the_bound():
    pipe = SimpleNamespace(send=lambda message: None)  # a process that never reads it
    with pytest.raises(TimeoutError, match="the averager did not take the round's group key within 0 s"):
        ask_within(pipe, "_set_group", {"group_bits": "0101"}, timeout_s=0.3, what="the round's group key")
