"""Chunked top-k sparsification with few-bit values (SparseLoCo / DeMo style).

The tensor is cut into chunks of ``chunk`` values (the last one may be shorter and keeps
proportionally fewer, at least one). Each chunk keeps the ``k`` values of largest magnitude:
their positions in the chunk (ascending, Elias-Fano coded: about 2 + log2(chunk / k) bits each,
below) and their values on ``2 ** value_bits`` levels evenly spaced from -1 to 1 (2 bits:
``{-1, -1/3, 1/3, 1}``) times the chunk's largest kept magnitude, one fp32 scale a chunk; with one
bit a value is its sign times the mean magnitude of the chunk's nonzero kept values. No level is
zero: a chunk with fewer than ``k`` nonzero values sends some zeros as a level. At k/chunk =
64/4096 and 2 bits that is 84 bytes for every 16 KiB of fp32, 195 x smaller. What is not sent,
or sent wrong, is not lost: ``ErrorFeedback`` carries the difference into the next round.

The average of M such contributions holds up to M x k values a chunk: it is not sparsified
again. The contributions are all-gathered instead (``gathers``), as SparseLoCo does: every
worker receives every other worker's payload and takes their mean itself (``gathered_mean``),
one of two ways (``mean``):

- ``"all"``: over all M contributions, as for a dense codec: a value one worker of four sent
  moves the params by a quarter of what it sent. Right under a momentum outer step (Nesterov),
  whose momentum already sums what arrives over rounds.
- ``"senders"``: value by value over the contributions that carry it: a value one worker of four
  sent moves the params by what that worker sent. Right under SparseLoCo's plain outer step (at
  64 of 4,096 most values are chosen by one worker a round, and a mean over all M shrinks them
  M-fold); under momentum the full per-value step overshoots.

Both settings travel in the header, so peers that would take different means refuse each
other's payloads.
"""

from __future__ import annotations

import numpy as np
import torch

from diloco.compression.codec import Codec, PayloadError, frombuffer, register

VALUE_BITS = (1, 2, 4, 8)
MEANS = ("all", "senders")
# header parameter b: the chunk length in its low 20 bits, the value bits in the next 4, the mean above
_CHUNK_MASK, _BITS_SHIFT, _MEAN_SHIFT = (1 << 20) - 1, 20, 24


@register
class TopK(Codec):
    name, codec_id, gathers = "topk", 4, True

    def __init__(self, k: int, chunk: int, value_bits: int = 2, mean: str = "all"):
        # the config's keys are checked by build_codec (validate_compression_config), in its words
        if value_bits not in VALUE_BITS or mean not in MEANS:
            raise ValueError(f"TopK: value_bits must be one of {VALUE_BITS} and mean one of {MEANS}")
        self.k, self.chunk, self.value_bits, self.mean = k, chunk, value_bits, mean
        self.align = chunk
        levels = 1 << value_bits
        self._levels = torch.tensor([-1 + 2 * i / (levels - 1) for i in range(levels)], dtype=torch.float32)

    def params(self) -> tuple[int, int]:
        return self.k, self.chunk | self.value_bits << _BITS_SHIFT | MEANS.index(self.mean) << _MEAN_SHIFT

    @property
    def label(self) -> str:
        return f"topk-{self.k}"

    @classmethod
    def describe_params(cls, a: int, b: int) -> str:
        bits, mean = b >> _BITS_SHIFT & 15, b >> _MEAN_SHIFT
        mean_name = MEANS[mean] if mean < len(MEANS) else f"#{mean}"
        return f"topk(k={a}, chunk={b & _CHUNK_MASK}, value_bits={bits}, mean={mean_name})"

    def _layout(self, numel: int) -> list[tuple[int, int, int]]:
        """(number of chunks, chunk length, values kept a chunk) for the full chunks and the tail."""
        full, tail = divmod(numel, self.chunk)
        layout = [(full, self.chunk, self.k)] if full else []
        if tail:
            layout.append((1, tail, min(tail, max(1, -(-self.k * tail // self.chunk)))))
        return layout

    def gathered_mean(self, contributions, numel: int) -> torch.Tensor:
        """With ``mean="senders"``: value by value, the weighted mean over the contributions whose
        payload carries the value (a kept value is never zero unless its whole chunk was); zero where
        none does. With ``mean="all"``: ``Codec.gathered_mean``, the weighted mean of all."""
        if self.mean == "all":
            return super().gathered_mean(contributions, numel)
        total, carried = torch.zeros(numel, dtype=torch.float32), torch.zeros(numel, dtype=torch.float32)
        for values, weight in contributions:
            total.add_(values * weight)  # two roundings, as Codec.gathered_mean says
            carried.add_((values != 0).to(torch.float32) * weight)
        return total.div_(carried.masked_fill_(carried == 0, 1.0))

    def body_bytes(self, numel: int) -> int:
        layout = self._layout(numel)
        chunks = sum(n for n, _, _ in layout)
        kept = sum(n * kept for n, _, kept in layout)
        return 4 * chunks + _position_bytes(layout) + -(-kept * self.value_bits // 8)

    def _quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's scale (fp32) and each value's level (uint8, an index into ``_levels``)."""
        if self.value_bits == 1:  # the sign, times the mean magnitude of the nonzero: the scale that errs least
            magnitude = values.abs()
            nonzero = (magnitude > 0).sum(dim=1).clamp_min_(1)
            return magnitude.sum(dim=1) / nonzero, (values > 0).to(torch.uint8)
        scale = values.abs().amax(dim=1)
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        top = len(self._levels) - 1
        code = torch.round((values / divisor[:, None] + 1) * (top / 2)).clamp_(0, top).to(torch.uint8)
        return scale, code

    def _encode(self, flat: torch.Tensor) -> bytes:
        scales, positions, codes, offset = [], [], [], 0
        layout = self._layout(flat.numel())
        for count, length, kept in layout:
            rows = flat[offset : offset + count * length].view(count, length)
            offset += count * length
            index = torch.topk(rows.abs(), kept, dim=1, sorted=False).indices.sort(dim=1).values
            scale, code = self._quantize(rows.gather(1, index))
            scales.append(scale)
            positions.append(index.to(torch.int32))
            codes.append(code.view(-1))
        if not scales:
            return b""
        bits, per_byte = self.value_bits, 8 // self.value_bits
        code = torch.cat(codes)
        code = torch.nn.functional.pad(code, (0, -code.numel() % per_byte)).view(-1, per_byte)
        packed = code[:, 0].clone()
        for slot in range(1, per_byte):
            packed |= code[:, slot] << (bits * slot)
        position_bits = [_elias_fano_bits(rows, length) for rows, (_, length, _) in zip(positions, layout)]
        packed_positions = np.packbits(torch.cat(position_bits).numpy(), bitorder="little").tobytes()
        return torch.cat(scales).numpy().tobytes() + packed_positions + packed.numpy().tobytes()

    def _decode(self, body: memoryview, numel: int) -> torch.Tensor:
        layout = self._layout(numel)
        chunks = sum(n for n, _, _ in layout)
        kept_total = sum(n * kept for n, _, kept in layout)
        scales = frombuffer(body[: 4 * chunks], torch.float32)
        values_at = 4 * chunks + _position_bytes(layout)
        bits = torch.from_numpy(np.unpackbits(np.frombuffer(body[4 * chunks : values_at], np.uint8), bitorder="little"))
        packed = frombuffer(body[values_at:], torch.uint8)
        width, mask = self.value_bits, (1 << self.value_bits) - 1
        shifts = range(0, 8, width)
        codes = torch.stack([(packed >> shift) & mask for shift in shifts], dim=1).view(-1)[:kept_total]
        out = torch.zeros(numel, dtype=torch.float32)
        offset = chunk_offset = kept_offset = bit_offset = 0
        for count, length, kept in layout:
            row_bits = _elias_fano_row_bits(length, kept)
            index = _elias_fano_positions(
                bits[bit_offset : bit_offset + count * row_bits].view(count, row_bits), length, kept
            )
            bit_offset += count * row_bits
            if bool((index >= length).any()) or (kept > 1 and not bool((index[:, 1:] > index[:, :-1]).all())):
                raise PayloadError("payload has top-k positions out of range or out of order")
            level = self._levels[codes[kept_offset : kept_offset + count * kept].to(torch.int64)].view(count, kept)
            values = level * scales[chunk_offset : chunk_offset + count, None]
            out[offset : offset + count * length].view(count, length).scatter_(1, index, values)
            offset += count * length
            chunk_offset += count
            kept_offset += count * kept
        return out


# Positions: Elias-Fano. The ``kept`` ascending positions of a chunk of ``length`` values each
# split into ``low`` bits (the lowest ``log2(length / kept)``, stored as they are) and the rest, the
# high part h; position i sets bit h_i + i of an "upper" bitmap of kept + (length-1 >> low) + 1
# bits, so the bitmap has exactly ``kept`` ones, in order. About 2 + log2(length / kept) bits a
# position, whatever the positions are (8 at 64 of 4,096, against 12 for the position itself): a
# payload's size depends on the codec's parameters and the number of values only.


def _low_bits(length: int, kept: int) -> int:
    return max(0, (length // kept).bit_length() - 1)


def _elias_fano_row_bits(length: int, kept: int) -> int:
    low = _low_bits(length, kept)
    return kept * low + kept + ((length - 1) >> low) + 1


def _position_bytes(layout: list[tuple[int, int, int]]) -> int:
    return -(-sum(count * _elias_fano_row_bits(length, kept) for count, length, kept in layout) // 8)


def _elias_fano_bits(positions: torch.Tensor, length: int) -> torch.Tensor:
    """The bits (uint8 0/1, row after row) of each row of ascending ``positions`` in a chunk of ``length``."""
    count, kept = positions.shape
    low = _low_bits(length, kept)
    low_bits = ((positions[:, :, None] >> torch.arange(low, dtype=torch.int32)) & 1).to(torch.uint8).view(count, -1)
    upper = torch.zeros(count, kept + ((length - 1) >> low) + 1, dtype=torch.uint8)
    upper.scatter_(1, ((positions >> low) + torch.arange(kept, dtype=torch.int32)).to(torch.int64), 1)
    return torch.cat([low_bits, upper], dim=1).view(-1)


def _elias_fano_positions(bits: torch.Tensor, length: int, kept: int) -> torch.Tensor:
    """The ascending positions (int64, one row a chunk) that ``_elias_fano_bits`` wrote into ``bits``
    (a row of ``_elias_fano_row_bits`` a chunk); raises ``PayloadError`` if a row's bitmap is not one
    of ``kept`` positions."""
    count = bits.shape[0]
    low = _low_bits(length, kept)
    weights = (1 << torch.arange(low, dtype=torch.int64)) if low else torch.zeros(0, dtype=torch.int64)
    low_part = (bits[:, : kept * low].view(count, kept, low).to(torch.int64) * weights).sum(dim=2)
    upper = bits[:, kept * low :]
    if not bool((upper.sum(dim=1, dtype=torch.int64) == kept).all()):
        raise PayloadError("payload's top-k positions are malformed")
    ones = upper.nonzero()[:, 1].view(count, kept)  # row-major: each row's ones in order
    return ((ones - torch.arange(kept)) << low) | low_part
