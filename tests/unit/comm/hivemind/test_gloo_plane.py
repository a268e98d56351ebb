"""The gloo data plane's own bounds, with real gloo process groups on loopback: a peer that
hivemind counted in the group but that never comes to the rendezvous fails the round within the
connect bound, not the all-reduce's; peers that meet average."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diloco.comm.hivemind.gloo_plane import DataPlane

pytestmark = pytest.mark.timeout(60)


def _plane(connect_s: float = 1.0, timeout_s: float = 30.0) -> DataPlane:
    return DataPlane("127.0.0.1", start_timeout_s=5.0, connect_timeout_s=connect_s, timeout_s=timeout_s)


def test_a_peer_that_never_comes_to_the_rendezvous_fails_the_round_within_the_connect_bound():
    leader, absent = _plane(), _plane()
    gathered = {"leader": leader.declaration(), "absent": absent.declaration()}
    started = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - whatever gloo raises: the round failed
        leader.all_reduce_sum(torch.ones(8), gathered, "leader")
    # the connect bound (1 s), not the all-reduce's (30 s); a margin for a busy machine
    assert time.monotonic() - started < 10.0


def test_peers_that_meet_at_the_rendezvous_average():
    planes = [_plane(connect_s=2.0), _plane(connect_s=2.0)]
    gathered = {f"p{i}": plane.declaration() for i, plane in enumerate(planes)}
    flats = [torch.full((1000,), float(i + 1)) for i in range(2)]
    errors = []

    def average(i: int) -> None:
        try:
            planes[i].all_reduce_sum(flats[i], gathered, f"p{i}")
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=average, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=45)
    assert not errors and all(torch.equal(flat, torch.full((1000,), 3.0)) for flat in flats), errors
