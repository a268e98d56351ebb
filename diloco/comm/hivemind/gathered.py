"""The reply of a reducer whose codec gathers (top-k): the contributions it kept, not their mean.

The mean of M sparse contributions holds up to M x k values a chunk; sending it back costs more
than the contributions themselves (6 bytes a value against under 2). So for a codec that
``gathers``, a reducer answers each sender of a part with the payloads of the part's other kept
senders as they arrived, with their weights, and every peer (the reducer too) takes the mean
itself: each payload decoded, scaled by the screening's factor, averaged in sender order as the
codec's ``gathered_mean`` says (top-k: as ``compression.topk_mean`` says). The same
bytes in the same order give every peer the same mean, bit for bit; what a worker receives in
all is the others' payloads, (M-1) x its own: an all-gather.

A reply's body: the number of entries (uint16), then per entry in sender order its sender index
(uint16), weight (float32) and payload length (uint32, 0 for the recipient's own payload, which
it has), then the payloads. The weights travel as float32, as in hivemind's messages.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.compression import Codec, PayloadError, all_finite

FORMAT = b"diloco-gathered-v2"  # in the averager's schema hash: peers that average otherwise do not match
_COUNT = struct.Struct("<H")
_ENTRY = struct.Struct("<HfI")


@dataclass(frozen=True)
class Kept:
    """One sender's contribution to a part, as its reducer received it."""

    sender: int  # its index among the group's senders
    weight: float
    payload: bytes


def pack(kept: Sequence[Kept], *, recipient: int) -> bytes:
    """The reply to sender ``recipient`` (-1: none, the reducer's own record): ``kept`` in sender
    order, without the recipient's own payload."""
    entries = sorted(kept, key=lambda k: k.sender)
    parts = [_COUNT.pack(len(entries))]
    for entry in entries:
        parts.append(_ENTRY.pack(entry.sender, entry.weight, 0 if entry.sender == recipient else len(entry.payload)))
    parts += [entry.payload for entry in entries if entry.sender != recipient]
    return b"".join(parts)


def unpack(reply: bytes | memoryview, *, recipient: int, own: bytes | None) -> list[Kept]:
    """The entries of a reply to ``recipient``, ``own`` (what it sent for the part) put back in
    its place. Raises ``PayloadError`` for a reply that is malformed."""
    view = memoryview(reply).cast("B")
    try:
        (count,) = _COUNT.unpack_from(view)
        header = [_ENTRY.unpack_from(view, _COUNT.size + i * _ENTRY.size) for i in range(count)]
    except struct.error:
        raise PayloadError(f"gathered reply truncated: {len(view)} bytes") from None
    offset, kept = _COUNT.size + count * _ENTRY.size, []
    senders = [sender for sender, _, _ in header]
    if senders != sorted(set(senders)):
        raise PayloadError("gathered reply lists its senders out of order or twice")
    for sender, weight, length in header:
        if length == 0:
            if sender != recipient or own is None:
                raise PayloadError(f"gathered reply leaves out the payload of sender {sender}")
            kept.append(Kept(sender, weight, own))
            continue
        if offset + length > len(view):
            raise PayloadError(f"gathered reply truncated: {len(view)} bytes")
        kept.append(Kept(sender, weight, bytes(view[offset : offset + length])))
        offset += length
    if offset != len(view):
        raise PayloadError(f"gathered reply has {len(view) - offset} bytes beyond its payloads")
    return kept


def mean(codec: Codec, kept: Sequence[Kept], numel: int, scales: Sequence[float]) -> torch.Tensor:
    """The mean of the ``kept`` payloads as ``codec.gathered_mean`` takes it (in the order given:
    sender order), each scaled by ``scales[sender]``. Raises ``PayloadError`` if a payload is bad
    or the mean is not finite."""
    if not kept:
        raise PayloadError("gathered reply holds no contribution")
    for entry in kept:
        if not (entry.weight > 0 and entry.sender < len(scales)):
            raise PayloadError(f"gathered reply has sender {entry.sender} with weight {entry.weight}")

    def decoded():
        for entry in kept:
            values = codec.decompress(entry.payload, numel)
            yield (values * scales[entry.sender] if scales[entry.sender] != 1.0 else values), entry.weight

    result = codec.gathered_mean(decoded(), numel)
    if not all_finite(result):
        raise PayloadError("gathered mean is not finite")
    return result


def as_received(kept: Sequence[Kept]) -> list[Kept]:
    """``kept`` as any recipient reads it (sender order, float32 weights): what the reducer's own
    mean is taken from, so that it equals every sender's."""
    return unpack(pack(kept, recipient=-1), recipient=-1, own=None)
