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

from diloco.comm.base import CommConfig, StateRank
from diloco.comm.hivemind.averager import ExactAverager
from diloco.comm.hivemind.backend import HivemindBackend

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


def _averager() -> ExactAverager:
    """An ExactAverager without its process: only the methods under test."""
    averager = object.__new__(ExactAverager)
    averager._parent_pid = -1  # not ours to shut down
    return averager


def _backend(**attributes) -> HivemindBackend:
    """A HivemindBackend without its DHT and averager processes: only the logic under test."""
    backend = object.__new__(HivemindBackend)
    backend.cfg = CommConfig(request_timeout_s=0.2, deadline_s=1.0)
    backend.roster = SimpleNamespace(stage=lambda stage: None)
    backend._others_averaged = lambda round_index: False
    backend._others_gone = lambda: False
    backend.client_mode = False
    for name, value in attributes.items():
        setattr(backend, name, value)
    return backend


@pytest.mark.parametrize("began_allreduce", [False, True], ids=["matchmaking", "all-reduce"])
def test_a_round_that_hivemind_never_ends_stops_at_its_limit(began_allreduce):
    control = _StuckControl(began_allreduce)
    started = time.monotonic()
    stage = "the all-reduce" if began_allreduce else "matchmaking"
    with pytest.raises(TimeoutError, match=f"no result from the averager after 1 s in {stage}"):
        _backend()._await_step(control, 0, limit=started + 1.0)
    assert control.cancelled and time.monotonic() - started < 5


def test_a_round_stops_looking_for_a_group_once_every_other_worker_has_left():
    control = _StuckControl(began_allreduce=False)
    with pytest.raises(TimeoutError, match="no other worker of the run is live"):
        _backend(_others_gone=lambda: True)._await_step(control, 0, limit=time.monotonic() + 30)
    assert control.cancelled


def test_a_state_download_that_never_ends_gives_up_at_the_timeout():
    def load_state_from_peers(timeout):
        threading.Event().wait(timeout)  # hivemind's MPFuture.result(timeout) past its time
        raise concurrent.futures.TimeoutError

    backend = _backend(
        _averagers=[SimpleNamespace(load_state_from_peers=load_state_from_peers)],
        _state_offers=lambda: [(3, StateRank(2))],  # a peer offers round 3, averaged by 2
        _live_peers=lambda: (1, 2),
        num_workers=2,
    )
    started = time.monotonic()
    assert backend.fetch_state(3, better_than=StateRank(1), timeout_s=1.0) is None
    assert time.monotonic() - started < 5


def test_the_averagers_tensors_held_by_a_stuck_all_reduce_are_waited_for_at_most_the_bound():
    averager = _averager()
    averager.lock_averaged_tensors, averager._averaged_tensors = mp.Lock(), [torch.zeros(2)]
    averager.lock_averaged_tensors.acquire()  # what the averager's process does through an all-reduce
    started = time.monotonic()
    with (
        pytest.raises(TimeoutError, match="the averager held its tensors for more than 0 s"),
        averager.tensors_within(0.3),
    ):
        pass
    assert time.monotonic() - started < 5
    averager.lock_averaged_tensors.release()
    with averager.tensors_within(0.3) as tensors:
        assert tensors[0].shape == (2,)


def test_a_group_key_the_averagers_process_never_takes_fails_at_the_bound():
    averager = _averager()
    averager._outer_pipe = SimpleNamespace(send=lambda message: None)  # a process that never reads it
    with pytest.raises(TimeoutError, match="the averager did not take the round's group key within 0 s"):
        averager.set_group("0101", target_group_size=2, timeout_s=0.3)
