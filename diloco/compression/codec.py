"""The wire format of a compressed tensor, and the codecs that need no quantization.

A ``Codec`` turns a flat fp32 tensor into a self-describing payload (``compress``) and back
(``decompress``). It is stateless, so the transport can run it wherever the bytes are made:
in the worker, or in hivemind's averager process. Error feedback, the one piece of state, is
``ErrorFeedback`` in error_feedback.py.

Every payload starts with a 20-byte header (magic, format version, codec id, number of values,
two codec parameters such as the block size), so a peer checks what it receives before using
it: ``decompress`` rejects a payload that is truncated, of another codec or size, or that
decodes to non-finite values, with a ``PayloadError`` that says which.

Codecs work on independent runs of ``align`` values from the start of the tensor (a block or a
chunk), so compressing a slice that starts at a multiple of ``align`` gives exactly the bytes of
that slice in the whole tensor's payload: transports may split a tensor at those boundaries.
A codec that ``gathers`` (top-k) has its contributions all-gathered rather than averaged by
reducers: the average of sparse vectors is denser than each, and is not compressed again; every
peer takes it itself, as the codec's ``gathered_mean`` says.
"""

from __future__ import annotations

import abc
import math
import struct
from collections.abc import Iterable
from typing import ClassVar

import torch

_HEADER = struct.Struct("<2sBBQII")  # magic, version, codec id, numel, param a, param b
_MAGIC, _VERSION = b"DL", 4  # 3: top-k positions Elias-Fano coded; 4: top-k's value bits and mean in its header
HEADER_BYTES = _HEADER.size
PAYLOAD_FORMAT = b"diloco-payload-v%d" % _VERSION  # in hivemind's schema hash: other versions do not match


class PayloadError(ValueError):
    """A received payload cannot be used; the message says why, in one line."""


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite. A NaN or an infinity anywhere makes the sum
    one, so a finite sum (one pass, no temporary) settles it; only when it is not (or finite
    values overflowed it) is each value looked at."""
    return math.isfinite(float(tensor.sum())) or bool(torch.isfinite(tensor).all())


class Codec(abc.ABC):
    """Stateless compression of a flat fp32 tensor into bytes that describe themselves."""

    name: ClassVar[str]
    codec_id: ClassVar[int]
    lossless: ClassVar[bool] = False
    # every worker receives every other's payload and averages them itself (no reducer's reply)
    gathers: ClassVar[bool] = False
    align: int = 1  # values per independent block: split points must be multiples of it
    # the codec of each round is agreed by its peers among candidates (adaptive.py); this one makes
    # no payload itself
    chosen_per_round: ClassVar[bool] = False

    @property
    def candidates(self) -> tuple[Codec, ...]:
        """The codecs a round may travel with: this one (several for one chosen per round)."""
        return (self,)

    def agreed(self, declarations: Iterable[object]) -> Codec:
        """The codec a round travels with, given what its peers declared at matchmaking: this one."""
        return self

    def params(self) -> tuple[int, int]:
        """The codec's two header parameters (0 when unused)."""
        return 0, 0

    @property
    def label(self) -> str:
        """The codec's name in a round's record, unique among the candidates of one chosen per round."""
        return self.name

    @classmethod
    def describe_params(cls, a: int, b: int) -> str:
        """The codec with header parameters ``a`` and ``b``, as an error message names it."""
        return f"{cls.name}({a}, {b})" if (a, b) != (0, 0) else cls.name

    def gathered_mean(self, contributions: Iterable[tuple[torch.Tensor, float]], numel: int) -> torch.Tensor:
        """For a codec that ``gathers``: the mean every peer takes of the decoded contributions
        ``(values, weight)``, summed in the order given (so the same inputs in the same order give
        every peer the same bits). Here the weighted mean of all of them."""
        total, accumulator = 0.0, torch.zeros(numel, dtype=torch.float32)
        for values, weight in contributions:
            # two roundings, not add_'s alpha: that is a fused multiply-add on some CPU kernels and
            # not on others, and every peer takes this sum, on whatever CPU it has
            accumulator.add_(values * weight)
            total += weight
        return accumulator.div_(total)

    @abc.abstractmethod
    def body_bytes(self, numel: int) -> int:
        """Exact size of the body for ``numel`` values."""

    @abc.abstractmethod
    def _encode(self, flat: torch.Tensor) -> bytes | memoryview:
        """The body for a flat fp32 CPU tensor (bytes, or a view of bytes that ``compress`` copies)."""

    @abc.abstractmethod
    def _decode(self, body: memoryview, numel: int) -> torch.Tensor:
        """A flat fp32 tensor from a body of exactly ``body_bytes(numel)`` bytes."""

    def payload_bytes(self, numel: int) -> int:
        """Exact size of ``compress`` of ``numel`` values: header and body."""
        return HEADER_BYTES + self.body_bytes(numel)

    def compress(self, tensor: torch.Tensor) -> bytes:
        flat = tensor.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        header = _HEADER.pack(_MAGIC, _VERSION, self.codec_id, flat.numel(), *self.params())
        return header + self._encode(flat)

    def decompress(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        """The flat fp32 tensor of ``numel`` values in ``payload``; raises ``PayloadError``."""
        view = memoryview(payload).cast("B")
        if len(view) < HEADER_BYTES:
            raise PayloadError(f"payload truncated: {len(view)} bytes, shorter than the {HEADER_BYTES}-byte header")
        magic, version, codec_id, count, a, b = _HEADER.unpack_from(view)
        if magic != _MAGIC or version != _VERSION:
            raise PayloadError(f"payload is not a diloco v{_VERSION} payload (magic {magic!r}, version {version})")
        if codec_id != self.codec_id or (a, b) != self.params():
            raise PayloadError(
                f"payload was compressed with codec {_describe(codec_id, a, b)}, expected {self.describe()}; "
                "every worker must use the same compression.* settings"
            )
        if count != numel:
            raise PayloadError(f"payload holds {count} values, expected {numel}")
        expected = self.payload_bytes(numel)
        if len(view) != expected:
            raise PayloadError(f"payload has {len(view)} bytes, expected {expected} for {numel} values")
        values = self._decode(view[HEADER_BYTES:], numel)
        if not all_finite(values):
            raise PayloadError("payload decodes to non-finite values (NaN or inf)")
        return values

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a peer receives when ``tensor`` is sent: ``decompress(compress(tensor))``, same shape."""
        return self.decompress(self.compress(tensor), tensor.numel()).view(tensor.shape)

    def restore(self, tensor: torch.Tensor) -> torch.Tensor:
        """``roundtrip`` without the checks a receiver makes (non-finite values pass through)."""
        flat = tensor.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        return self._decode(memoryview(self._encode(flat)), flat.numel()).view(tensor.shape)

    @property
    def reply_codec(self) -> Codec:
        """The codec a reducer compresses averages with: this one (a fault injector returns the intact one)."""
        return self

    def describe(self) -> str:
        return _describe(self.codec_id, *self.params())


_CODECS: dict[int, type[Codec]] = {}


def _describe(codec_id: int, a: int, b: int) -> str:
    cls = _CODECS.get(codec_id)
    return cls.describe_params(a, b) if cls is not None else f"#{codec_id}({a}, {b})"


def register(cls: type[Codec]) -> type[Codec]:
    _CODECS[cls.codec_id] = cls
    return cls


def frombuffer(body: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``body`` (copied, so it outlives the buffer and is writable)."""
    if len(body) == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(body), dtype=dtype)


@register
class NoCompression(Codec):
    """fp32 as it is: 4 bytes a value."""

    name, codec_id, lossless = "none", 0, True

    def body_bytes(self, numel: int) -> int:
        return 4 * numel

    def _encode(self, flat: torch.Tensor) -> memoryview:
        return memoryview(flat.numpy()).cast("B")  # copied once, into the payload

    def _decode(self, body: memoryview, numel: int) -> torch.Tensor:
        return frombuffer(body, torch.float32)


@register
class Float16(Codec):
    """IEEE half precision, 2 bytes a value; magnitudes beyond fp16's range are clamped to it."""

    name, codec_id = "fp16", 1
    _MAX = torch.finfo(torch.float16).max

    def body_bytes(self, numel: int) -> int:
        return 2 * numel

    def _encode(self, flat: torch.Tensor) -> bytes:
        return flat.clamp(-self._MAX, self._MAX).to(torch.float16).numpy().tobytes()

    def _decode(self, body: memoryview, numel: int) -> torch.Tensor:
        return frombuffer(body, torch.float16).to(torch.float32)
