"""The averaging's parts on the wire: payloads of the run's codec in hivemind's tensor messages.

A sender compresses each part of its pseudo-gradient; a reducer checks and decodes every part it
receives (a bad payload is a ``PayloadError``: the sender is dropped), averages in fp32, compresses
the average once and sends those bytes to every sender, and uses what they decode to for its own
share. Part boundaries fall on multiples of the codec's block (``aligned_part_size_bytes``), so a
part's payload is the same bytes the worker's error feedback computed for it.
"""

from __future__ import annotations

import torch
from hivemind.proto import runtime_pb2

from diloco.compression import Codec, PayloadError, all_finite


def bytes_part(payload: bytes) -> runtime_pb2.Tensor:
    """A payload as hivemind's tensor message (uint8, uncompressed: the codec has done the work)."""
    return runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.NONE, buffer=payload, size=[len(payload)], dtype="uint8"
    )


def compress_reply(codec: Codec, averaged: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """A reducer's average of one part as sent to every sender, and what it decodes to (kept by the reducer)."""
    payload = codec.compress(averaged)
    if codec.lossless:  # what the senders decode is these very values: no need to decode them here
        if not all_finite(averaged):
            raise PayloadError("payload decodes to non-finite values (NaN or inf)")
        return payload, averaged
    return payload, codec.decompress(payload, averaged.numel())


def compressed_as_sent(codec: Codec, part: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """Our own part's payload, and what a reducer decodes it to."""
    payload = codec.compress(part)
    return payload, codec.decompress(payload, part.numel())


def as_sent(codec: Codec, part: torch.Tensor) -> torch.Tensor:
    """Our own part as a reducer would decode it (``codec.roundtrip``; a lossless codec's is the part)."""
    if codec.lossless:
        if not all_finite(part):
            raise PayloadError("payload decodes to non-finite values (NaN or inf)")
        return part
    return codec.roundtrip(part)


def decode_part(codec: Codec, serialized: runtime_pb2.Tensor, numel: int) -> torch.Tensor:
    """A part a peer sent, as ``codec`` decodes it to ``numel`` values; PayloadError when it is not
    a payload of ours (another dtype, a compressed tensor) or we expected no more parts."""
    if serialized.dtype != "uint8" or serialized.compression != runtime_pb2.CompressionType.NONE:
        raise PayloadError(f"payload is a {serialized.dtype} tensor, not the bytes of a compressed part")
    if numel < 0:
        raise PayloadError("more parts than this peer reduces")
    return codec.decompress(serialized.buffer, numel)


# hivemind cuts each reducer's share into parts and a reducer answers part k only once every
# sender's part k is in: on slow links the last part's replies are a tail nothing overlaps, so
# small parts pay there (testbed, 4 peers at 20 Mbit/s, fp32, all-reduce efficiency: 10 MB 0.753
# at 512 KiB parts -> 0.802 at 64 KiB, 40 MB 0.722 -> 0.784; 2 MiB 0.61). Every part also costs a
# fixed amount of work (messages, executor hops), which dominates on fast links with large
# payloads (85M fp32 values, 2 peers on loopback: 11.5 s a round at 64 KiB parts, 6.1 s at
# 512 KiB, 4.6 s at 2 MiB). So a payload is cut into about ``PARTS_PER_PAYLOAD`` parts, each
# between ``MIN_PART_WIRE_BYTES`` and ``MAX_PART_WIRE_BYTES`` on the wire: its tail is then at most
# a few percent of the round whatever the link. Sized on the wire, so a compressed part is no
# smaller and its framing stays negligible.
MIN_PART_WIRE_BYTES = 64 * 1024
MAX_PART_WIRE_BYTES = 4 * 1024 * 1024
PARTS_PER_PAYLOAD = 128


def aligned_part_size_bytes(codec: Codec, total_values: int = 0) -> int:
    """hivemind's part size, in fp32 bytes (it cuts parts of size / 4 values from each tensor's
    start) for a payload of ``total_values``: about 1/``PARTS_PER_PAYLOAD`` of it once compressed,
    within the bounds above, a multiple of the codec's block so that no block straddles two parts."""
    sample = 1 << 20
    wire_bytes_per_value = codec.payload_bytes(sample) / sample
    wire_bytes = min(
        MAX_PART_WIRE_BYTES, max(MIN_PART_WIRE_BYTES, total_values * wire_bytes_per_value / PARTS_PER_PAYLOAD)
    )
    values = max(1, round(wire_bytes / wire_bytes_per_value) // codec.align) * codec.align
    return 4 * values
