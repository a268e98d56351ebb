"""The gloo data plane between real hivemind peers in real processes: identical results, the
ring's byte count, a dropped contribution, a peer without the plane, and a peer that dies
inside the all-reduce."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import queue
import signal

import pytest
import torch

from diloco.comm.config import CommConfig
from diloco.comm.hivemind.gloo_plane import ring_bytes
from diloco.comm.hivemind.settings import HivemindConfig
from diloco.tools import warm_start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SHAPES = [(300_000,), (129, 7), (5,)]
NUMEL = sum(torch.Size(shape).numel() for shape in SHAPES)


def _tensors(index: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    return [torch.randn(shape, generator=g) * 0.01 for shape in SHAPES]


def _peer(
    index: int, count: int, bootstrap: list[str], plane: str, bad: str, deadline_s: float, results: mp.Queue
) -> None:
    """One worker: a backend averages this worker's tensors once, then reports."""
    warm_start.own_hivemind_locks()  # as a warm command does: a peer killed holding one hangs no other
    mp.set_start_method("fork", force=True)  # hivemind forks its averager, as in `diloco train`
    from diloco.comm.hivemind.backend import HivemindBackend

    hivemind = HivemindConfig(initial_peers=bootstrap, matchmaking_s=8, request_timeout_s=3, data_plane=plane)
    cfg = CommConfig(run_id="plane", deadline_s=deadline_s, hivemind=hivemind)
    backend = HivemindBackend(cfg, templates=_tensors(0), num_workers=count, codec=_codec())
    try:
        tensors = _tensors(index)
        if bad == "nan":
            tensors[0][7] = float("nan")
        if bad == "die":  # killed inside the all-reduce: after matchmaking, before its first chunk
            from diloco.comm.hivemind import gloo_plane

            def die(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            gloo_plane.DataPlane.all_reduce_sum = die
        result = backend.averaging.all_reduce_mean(tensors, 1.0 + index, round_index=0, deadline_s=deadline_s)
        digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in tensors)).hexdigest()
        # numpy arrays, sent by value (a torch tensor would travel in this peer's shared memory)
        arrays = [t.numpy() for t in tensors]
        results.put((index, result.ok, result.peers, result.bytes_sent, result.error, digest, arrays))
    finally:
        backend.shutdown()


def _codec():
    from diloco.compression import NoCompression

    return NoCompression()


def _run_peers(
    count: int, planes: list[str], bad: dict[int, str] | None = None, reports: int | None = None, deadline_s: float = 30
) -> dict:
    from diloco.comm.hivemind.peer import start_dht, visible_addresses

    bad = bad or {}
    bootstrap = start_dht(HivemindConfig())
    context = warm_start.context()  # a fresh process each, forked with torch and hivemind imported
    results = context.Queue()
    peers = [
        context.Process(
            target=_peer,
            args=(i, count, visible_addresses(bootstrap), planes[i], bad.get(i, ""), deadline_s, results),
        )
        for i in range(count)
    ]
    try:
        for process in peers:
            process.start()
        found: dict = {}
        for _ in range(count if reports is None else reports):
            index, ok, peers_in, sent, error, digest, arrays = results.get(timeout=150)
            tensors = [torch.from_numpy(array) for array in arrays]
            found[index] = dict(ok=ok, peers=peers_in, sent=sent, error=error, digest=digest, tensors=tensors)
        return found
    except queue.Empty:
        pytest.fail("a peer did not report within 150 s")
    finally:
        for process in peers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        with contextlib.suppress(Exception):
            bootstrap.shutdown()


def _run_peers_over_the_plane(count: int, bad: dict[int, str] | None = None) -> dict:
    """``_run_peers`` over the gloo plane, run once more if the plane failed the round: about once
    in 20 multi-worker runs hivemind's matchmaking puts a peer in a leader's group that it never
    joins, and the others' rendezvous on the plane then fails at its bound (10 s), whatever the test
    is about. A plane that fails every time fails the second run too."""
    found = _run_peers(count, ["gloo"] * count, bad)
    if not any(report["error"].startswith("data plane: ") for report in found.values()):
        return found
    return _run_peers(count, ["gloo"] * count, bad)


def _mean(indices: list[int]) -> list[torch.Tensor]:
    weights = [1.0 + i for i in indices]
    vectors = [_tensors(i) for i in indices]
    return [sum(w * v[k] for w, v in zip(weights, vectors)) / sum(weights) for k in range(len(SHAPES))]


def test_three_peers_over_the_plane_end_identical_and_count_the_ring_bytes():
    found = _run_peers_over_the_plane(3)
    assert all(found[i]["ok"] and found[i]["peers"] == 3 for i in range(3)), found
    assert len({found[i]["digest"] for i in range(3)}) == 1, "peers differ"
    assert all(found[i]["sent"] == ring_bytes(NUMEL, 3) for i in range(3))
    for got, want in zip(found[0]["tensors"], _mean([0, 1, 2])):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_a_dropped_contribution_takes_part_with_nothing_and_the_others_average():
    found = _run_peers_over_the_plane(3, bad={2: "nan"})
    errors = {i: report["error"] for i, report in found.items()}
    assert found[0]["ok"] and found[1]["ok"] and found[0]["digest"] == found[1]["digest"], errors
    assert found[0]["peers"] == 2
    assert not found[2]["ok"] and found[2]["peers"] == 0  # it knows it was dropped: no retry, takes the state
    for got, want in zip(found[0]["tensors"], _mean([0, 1])):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_a_group_with_a_peer_without_the_plane_averages_through_hivemind():
    found = _run_peers(2, ["gloo", "hivemind"])
    assert found[0]["ok"] and found[1]["ok"] and found[0]["digest"] == found[1]["digest"]
    # hivemind's butterfly: half the payload to the other reducer, the other half's mean back,
    # with message framing on top (exactly the ring's count over gloo)
    assert found[0]["sent"] != ring_bytes(NUMEL, 2)
    for got, want in zip(found[0]["tensors"], _mean([0, 1])):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_a_peer_killed_inside_the_all_reduce_fails_the_round_within_its_bound():
    # the survivor waits for the dead peer's part until the round's deadline: a short one
    found = _run_peers(2, ["gloo"] * 2, bad={1: "die"}, reports=1, deadline_s=12)
    survivor = found[0]
    assert not survivor["ok"]
    assert survivor["error"], survivor
    # the survivor keeps its own pseudo-gradient (the outer step then applies it alone)
    for got, want in zip(survivor["tensors"], _tensors(0)):
        assert torch.equal(got, want)
