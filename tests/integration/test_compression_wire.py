"""Compressed averaging between real hivemind peers in real processes: identical results, the
bytes they claim, and a peer with bad payloads dropped while the round goes on."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import queue

import pytest
import torch

from diloco.comm.base import CommConfig
from diloco.compression import CompressionConfig, build_codec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# one tensor spans three hivemind parts (131072 values each), the others are odd-sized
SHAPES = [(300_000,), (129, 7), (5,)]


def _tensors(index: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    return [torch.randn(shape, generator=g) * 0.01 for shape in SHAPES]


def _peer(index: int, count: int, bootstrap: list[str], codecs: list[str], bad: str, results: mp.Queue) -> None:
    """One worker: for each codec, a fresh backend averages this worker's tensors once."""
    mp.set_start_method("fork", force=True)  # hivemind forks its averager, as in `diloco train`
    from diloco.comm.hivemind.backend import HivemindBackend
    from diloco.worker.faults import BadPayloadCodec

    for name in codecs:
        codec = build_codec(CompressionConfig(name=name))
        if bad:
            codec = BadPayloadCodec(codec, bad)
        cfg = CommConfig(
            run_id=f"wire_{name}", initial_peers=bootstrap, matchmaking_s=8, request_timeout_s=3, deadline_s=40
        )
        backend = HivemindBackend(cfg, templates=_tensors(0), num_workers=count, codec=codec)
        try:
            tensors = _tensors(index)
            result = backend.all_reduce_mean(tensors, 1.0 + index, round_index=0, deadline_s=40)
            digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in tensors)).hexdigest()
            # as numpy arrays, sent by value: a torch tensor would travel in this peer's shared memory,
            # whose torch_shm_manager (holding this process's exit sentinel) would then outlive it for as
            # long as the test holds the tensor, and each join below would wait out its whole timeout
            results.put((name, index, result.ok, result.bytes_sent, digest, [t.numpy() for t in tensors]))
        finally:
            backend.shutdown()


def _run_peers(count: int, codecs: list[str], bad_peer: int = -1, bad: str = "") -> dict:
    from diloco.comm.hivemind.backend import start_dht, visible_addresses

    bootstrap = start_dht(CommConfig())
    context = mp.get_context("spawn")
    results = context.Queue()
    peers = [
        context.Process(
            target=_peer,
            args=(i, count, visible_addresses(bootstrap), codecs, bad if i == bad_peer else "", results),
        )
        for i in range(count)
    ]
    try:
        for process in peers:
            process.start()
        found: dict = {}
        for _ in range(count * len(codecs)):
            name, index, ok, sent, digest, arrays = results.get(timeout=120)
            tensors = [torch.from_numpy(array) for array in arrays]
            found[(name, index)] = {"ok": ok, "sent": sent, "digest": digest, "tensors": tensors}
        return found
    except queue.Empty:
        pytest.fail("a peer did not report within 120 s")
    finally:
        for process in peers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        with contextlib.suppress(Exception):
            bootstrap.shutdown()


# fp16 differs from int4 only inside the codec (unit-tested); int8 is the bad-payload test's codec
WIRE_CODECS = ["none", "int4", "topk"]


def test_two_peers_end_identical_with_each_codec_and_count_the_compressed_bytes():
    found = _run_peers(2, WIRE_CODECS)
    weights = [1.0, 2.0]
    exact = [(a * weights[0] + b * weights[1]) / 3 for a, b in zip(_tensors(0), _tensors(1))]
    for name in WIRE_CODECS:
        codec = build_codec(CompressionConfig(name=name))
        first, second = found[(name, 0)], found[(name, 1)]
        assert first["ok"] and second["ok"], name
        assert first["digest"] == second["digest"], f"{name}: peers differ"
        # a peer sends half its payload to the other reducer and the average of its own half back:
        # 2 (n-1)/n = 1 payload, as the simulator's link model counts it (plus message framing).
        # Top-k gathers: the reducer sends back its own payload of its half, not an average, so
        # each peer sends its whole payload once: (n-1) payloads, as much again
        payload = sum(codec.payload_bytes(torch.Size(shape).numel()) for shape in SHAPES)
        for peer in (first, second):
            assert 0.97 * payload < peer["sent"] < 1.03 * payload, f"{name}: {peer['sent']} bytes for {payload}"
        means = exact
        if name == "topk":  # the exact mean of what the two sent: nothing sparsified again
            sent_by = [[codec.roundtrip(t) for t in _tensors(i)] for i in (0, 1)]
            means = [(a * weights[0] + b * weights[1]) / 3 for a, b in zip(*sent_by)]
        tolerance = {"none": 1e-6, "fp16": 1e-4, "int8": 4e-4, "int4": 7e-3, "topk": 1e-7}[name]
        for got, want in zip(first["tensors"], means):
            torch.testing.assert_close(got, want, atol=tolerance, rtol=0)


def test_a_peer_with_bad_payloads_is_dropped_and_the_others_average():
    found = _run_peers(3, ["int8"], bad_peer=2, bad="nan")
    honest = [found[("int8", 0)], found[("int8", 1)]]
    assert all(peer["ok"] for peer in honest)
    assert honest[0]["digest"] == honest[1]["digest"]
    assert not found[("int8", 2)]["ok"]  # its own round failed: it takes the others' state afterwards
    # the honest mean (values ~0.01, int8 error ~1e-4): worker 2's contribution is not in it
    want = [(a * 1.0 + b * 2.0) / 3 for a, b in zip(_tensors(0), _tensors(1))]
    for got, expected in zip(honest[0]["tensors"], want):
        torch.testing.assert_close(got, expected, atol=3e-4, rtol=0)
