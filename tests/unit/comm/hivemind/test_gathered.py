"""A gathering reducer's reply (comm/hivemind/gathered.py): every reader takes the same mean."""

from __future__ import annotations

import pytest
import torch

from diloco.comm.hivemind import gathered
from diloco.comm.hivemind.gathered import Kept
from diloco.compression import CompressionConfig, PayloadError, build_codec


def _kept(codec, count: int, numel: int) -> list[Kept]:
    g = torch.Generator().manual_seed(0)
    return [Kept(i, 1.0 + i / 3, codec.compress(torch.randn(numel, generator=g))) for i in range(count)]


def test_every_sender_and_the_reducer_take_the_same_mean_from_a_reply_without_their_own_payload():
    codec = build_codec(CompressionConfig(name="topk", topk_k=8, topk_chunk=256, topk_mean="senders"))
    kept, numel, scales = _kept(codec, 4, 1000), 1000, [1.0, 0.5, 1.0, 1.0]
    reducers = gathered.mean(codec, gathered.as_received(kept), numel, scales)
    for me in range(4):
        reply = gathered.pack(kept, recipient=me)
        assert len(reply) == 2 + 4 * 10 + sum(len(k.payload) for k in kept if k.sender != me)
        mine = gathered.mean(codec, gathered.unpack(reply, recipient=me, own=kept[me].payload), numel, scales)
        assert torch.equal(mine, reducers)  # bit for bit
    weights = [float(torch.tensor(k.weight, dtype=torch.float32)) for k in kept]
    decoded = [codec.decompress(k.payload, numel) * s for k, s in zip(kept, scales)]
    carriers = sum(w * (d != 0) for w, d in zip(weights, decoded))  # each value over its senders
    exact = sum(w * d for w, d in zip(weights, decoded)) / carriers.masked_fill(carriers == 0, 1.0)
    torch.testing.assert_close(reducers, exact, atol=1e-6, rtol=0)  # every kept value, not sparsified again
    assert int((reducers != 0).sum()) > 8 * 4  # denser than any one contribution (8 of 256 a chunk)


def test_a_malformed_reply_is_refused_with_a_reason():
    codec = build_codec(CompressionConfig(name="topk", topk_k=8, topk_chunk=256, topk_mean="senders"))
    kept = _kept(codec, 3, 500)
    reply = gathered.pack(kept, recipient=1)
    with pytest.raises(PayloadError, match="truncated"):
        gathered.unpack(reply[:-1], recipient=1, own=kept[1].payload)
    with pytest.raises(PayloadError, match="leaves out the payload of sender 1"):
        gathered.unpack(reply, recipient=2, own=kept[2].payload)
    with pytest.raises(PayloadError, match="beyond its payloads"):
        gathered.unpack(reply + b"x", recipient=1, own=kept[1].payload)
    with pytest.raises(PayloadError, match="no contribution"):
        gathered.mean(codec, [], 500, [1.0])
