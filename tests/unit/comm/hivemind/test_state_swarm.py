"""A state downloaded in parts from several peers at once, over fake transports: every part
comes once, a peer that serves a corrupt part is refused and its parts come from another, and a
download that broke goes on with only the parts still missing."""

from __future__ import annotations

import asyncio
import time

import torch

from diloco.comm.hivemind.state_parts import byte_views, flatten, manifest_of, read_range
from diloco.comm.hivemind.state_swarm import SwarmDownload


def _state() -> dict:
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(300, 7, generator=generator), torch.randn(2000, generator=generator)]
    momenta = {i: {"momentum_buffer": torch.randn(p.shape, generator=generator)} for i, p in enumerate(params)}
    optimizer = {"state": momenta, "param_groups": [{"lr": 0.7, "momentum": 0.9, "nesterov": True, "params": [0, 1]}]}
    return {"global_params": params, "optimizer": optimizer}


class _Peers:
    """Peers that serve ``state``'s parts: ``corrupt`` ones flip a byte of each, a ``broken`` one's
    stream ends in an error after ``breaks_after`` parts; ``asked`` records who was asked for what."""

    def __init__(self, state: dict, *, corrupt=(), broken=(), breaks_after: int = 3):
        self.manifest = manifest_of(state)
        self.views = byte_views(flatten(state)[1])
        self.corrupt, self.broken, self.breaks_after = set(corrupt), set(broken), breaks_after
        self.asked: list[tuple[str, int]] = []
        self.sent = 0

    async def fetch(self, peer: str, parts: range):
        for part in parts:
            if peer in self.broken and self.sent >= self.breaks_after:
                raise ConnectionResetError("the stream broke")
            self.asked.append((peer, part))
            data = bytearray(read_range(self.views, *self.manifest.span(part)))
            if peer in self.corrupt:
                data[len(data) // 2] ^= 0xFF
            self.sent += 1
            await asyncio.sleep(0)  # the other peers' streams go on meanwhile
            yield part, bytes(data)


def _download(peers: _Peers, sources: list[str], download: SwarmDownload | None = None) -> SwarmDownload:
    download = download or SwarmDownload(peers.manifest, b"metadata")
    asyncio.run(download.run(sources, peers.fetch, deadline=time.monotonic() + 30))
    return download


def _params_equal(state: dict, expected: dict) -> bool:
    return all(torch.equal(a, b) for a, b in zip(state["global_params"], expected["global_params"], strict=True))


def test_two_peers_each_serve_a_share_and_every_part_comes_once():
    state = _state()
    peers = _Peers(state)
    download = _download(peers, ["a", "b"])
    assert download.done and _params_equal(download.state(), state)
    asked = [part for _, part in peers.asked]
    assert sorted(asked) == list(range(peers.manifest.parts))  # each part once: the parts cover the state exactly
    assert {peer for peer, _ in peers.asked} == {"a", "b"} and set(download.plan.served) == {"a", "b"}


def test_a_peer_serving_a_corrupt_part_is_refused_and_the_part_comes_from_another():
    state = _state()
    peers = _Peers(state, corrupt={"bad"})
    download = _download(peers, ["bad", "good"])
    assert download.done and _params_equal(download.state(), state)
    assert download.plan.refused == {"bad"} and "bad" not in download.plan.served
    first_bad = next(part for peer, part in peers.asked if peer == "bad")
    assert ("good", first_bad) in peers.asked  # refetched from the other peer
    assert sum(peer == "bad" for peer, _ in peers.asked) == 1  # asked nothing more after its corrupt part


def test_a_peer_whose_stream_breaks_leaves_its_parts_to_the_others():
    state = _state()
    peers = _Peers(state, broken={"flaky"}, breaks_after=5)
    download = _download(peers, ["flaky", "good"])
    assert download.done and _params_equal(download.state(), state)


def test_a_broken_download_resumes_with_only_the_missing_parts():
    state = _state()
    peers = _Peers(state, broken={"only"}, breaks_after=11)
    download = _download(peers, ["only"])
    assert not download.done  # its one source broke
    got = {part for _, part in peers.asked}
    assert len(got) == 11 and len(download.plan.missing) == peers.manifest.parts - 11
    peers.asked.clear()
    _download(peers, ["another"], download)  # the same state, offered by another peer
    assert download.done and _params_equal(download.state(), state)
    assert {part for _, part in peers.asked} == set(range(peers.manifest.parts)) - got  # only what was missing


def test_a_download_with_no_source_left_ends_before_its_deadline():
    state = _state()
    peers = _Peers(state, corrupt={"a", "b"})
    started = time.monotonic()
    download = _download(peers, ["a", "b"])
    assert not download.done and download.plan.refused == {"a", "b"} and time.monotonic() - started < 10
