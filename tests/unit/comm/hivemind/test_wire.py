"""The averaging's parts on the wire: only the bytes of a payload are read, and parts fall on the codec's blocks."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import serialize_torch_tensor

from diloco.comm.hivemind.wire import aligned_part_size_bytes, bytes_part, decode_part
from diloco.compression import CompressionConfig, PayloadError, build_codec


def test_hivemind_parts_must_be_compressed_bytes():
    codec = build_codec(CompressionConfig(name="int4", block_size=8))
    with pytest.raises(PayloadError, match="float32 tensor, not the bytes"):
        decode_part(codec, serialize_torch_tensor(torch.ones(3)), 3)
    torch.testing.assert_close(decode_part(codec, bytes_part(codec.compress(torch.ones(3))), 3), torch.ones(3))
    assert aligned_part_size_bytes(build_codec(CompressionConfig(name="topk", topk_chunk=3000))) // 4 % 3000 == 0
