"""Chunked top-k sparsification with 2-bit values (SparseLoCo / DeMo style).

The tensor is cut into chunks of ``chunk`` values (the last one may be shorter and keeps
proportionally fewer, at least one). Each chunk keeps the ``k`` values of largest magnitude:
their positions in the chunk (ascending; 12 bits each, two in three bytes, for chunks of at most
4,096 values, else 16 bits) and their values on four levels ``{-1, -1/3, 1/3, 1}`` times the
chunk's largest kept magnitude (one fp32 scale a chunk), four values a byte. At k/chunk =
64/4096 that is 116 bytes for every 16 KiB of fp32, 141 x smaller. What is not sent
is not lost: ``ErrorFeedback`` carries it into the next round.

The average of M such contributions holds up to M x k values a chunk: it is not sparsified
again. The contributions are all-gathered instead (``gathers``), as SparseLoCo does: every
worker receives every other worker's payload and takes their mean itself, value by value over
the contributions that carry the value (``gathered_mean``): a value one worker of four sent
moves the params by what that worker sent, not by a quarter of it. (A mean over all M would
shrink every rarely chosen value M-fold; at 64 of 4,096 most values are chosen by one worker a
round, and that mean trained markedly worse.)
"""

from __future__ import annotations

import torch

from diloco.compression.codec import Codec, PayloadError, frombuffer, register

_LEVELS = torch.tensor([-1.0, -1 / 3, 1 / 3, 1.0])


@register
class TopK(Codec):
    name, codec_id, gathers = "topk", 4, True

    def __init__(self, k: int, chunk: int):  # checked by build_codec (validate_compression_config)
        self.k, self.chunk = k, chunk
        self.align = chunk

    def params(self) -> tuple[int, int]:
        return self.k, self.chunk

    @property
    def _packed_positions(self) -> bool:
        """Positions in 12 bits (every position of a chunk of at most 4,096 values fits)."""
        return self.chunk <= 4096

    def _position_bytes(self, kept: int) -> int:
        return -(-3 * kept // 2) if self._packed_positions else 2 * kept

    def _layout(self, numel: int) -> list[tuple[int, int, int]]:
        """(number of chunks, chunk length, values kept a chunk) for the full chunks and the tail."""
        full, tail = divmod(numel, self.chunk)
        layout = [(full, self.chunk, self.k)] if full else []
        if tail:
            layout.append((1, tail, min(tail, max(1, -(-self.k * tail // self.chunk)))))
        return layout

    def gathered_mean(self, contributions, numel: int) -> torch.Tensor:
        """Value by value, the weighted mean over the contributions whose payload carries the value
        (a kept value is never zero unless its whole chunk was); zero where none does."""
        total, carried = torch.zeros(numel, dtype=torch.float32), torch.zeros(numel, dtype=torch.float32)
        for values, weight in contributions:
            total.add_(values * weight)  # two roundings, as Codec.gathered_mean says
            carried.add_((values != 0).to(torch.float32) * weight)
        return total.div_(carried.masked_fill_(carried == 0, 1.0))

    def body_bytes(self, numel: int) -> int:
        chunks = sum(n for n, _, _ in self._layout(numel))
        kept = sum(n * kept for n, _, kept in self._layout(numel))
        return 4 * chunks + self._position_bytes(kept) + -(-kept // 4)

    def _encode(self, flat: torch.Tensor) -> bytes:
        scales, positions, codes, offset = [], [], [], 0
        for count, length, kept in self._layout(flat.numel()):
            rows = flat[offset : offset + count * length].view(count, length)
            offset += count * length
            index = torch.topk(rows.abs(), kept, dim=1, sorted=False).indices.sort(dim=1).values
            values = rows.gather(1, index)
            scale = values.abs().amax(dim=1)
            divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
            code = torch.round((values / divisor[:, None] + 1) * 1.5).clamp_(0, 3).to(torch.uint8)
            scales.append(scale)
            positions.append(index.to(torch.int32).view(-1))
            codes.append(code.view(-1))
        if not scales:
            return b""
        code = torch.cat(codes)
        code = torch.nn.functional.pad(code, (0, -code.numel() % 4)).view(-1, 4)
        packed = code[:, 0] | (code[:, 1] << 2) | (code[:, 2] << 4) | (code[:, 3] << 6)
        packed_positions = self._pack_positions(torch.cat(positions))
        return torch.cat(scales).numpy().tobytes() + packed_positions + packed.numpy().tobytes()

    def _pack_positions(self, positions: torch.Tensor) -> bytes:
        if not self._packed_positions:
            return positions.to(torch.uint16).numpy().tobytes()
        pairs = torch.nn.functional.pad(positions, (0, positions.numel() % 2)).view(-1, 2)
        low, high = pairs[:, 0], pairs[:, 1]
        packed = torch.stack([low & 0xFF, (low >> 8) | ((high & 0xF) << 4), high >> 4], dim=1).to(torch.uint8)
        return packed.view(-1)[: self._position_bytes(positions.numel())].numpy().tobytes()

    def _unpack_positions(self, body: memoryview, kept: int) -> torch.Tensor:
        if not self._packed_positions:
            return frombuffer(body, torch.uint16).to(torch.int64)
        raw = frombuffer(body, torch.uint8).to(torch.int64)
        triples = torch.nn.functional.pad(raw, (0, -raw.numel() % 3)).view(-1, 3)
        low = triples[:, 0] | ((triples[:, 1] & 0xF) << 8)
        high = (triples[:, 1] >> 4) | (triples[:, 2] << 4)
        return torch.stack([low, high], dim=1).view(-1)[:kept]

    def _decode(self, body: memoryview, numel: int) -> torch.Tensor:
        layout = self._layout(numel)
        chunks = sum(n for n, _, _ in layout)
        kept_total = sum(n * kept for n, _, kept in layout)
        scales = frombuffer(body[: 4 * chunks], torch.float32)
        values_at = 4 * chunks + self._position_bytes(kept_total)
        positions = self._unpack_positions(body[4 * chunks : values_at], kept_total)
        packed = frombuffer(body[values_at:], torch.uint8)
        codes = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).view(-1)[:kept_total]
        out = torch.zeros(numel, dtype=torch.float32)
        offset = chunk_offset = kept_offset = 0
        for count, length, kept in layout:
            index = positions[kept_offset : kept_offset + count * kept].view(count, kept)
            if bool((index >= length).any()) or (kept > 1 and not bool((index[:, 1:] > index[:, :-1]).all())):
                raise PayloadError("payload has top-k positions out of range or out of order")
            level = _LEVELS[codes[kept_offset : kept_offset + count * kept].to(torch.int64)].view(count, kept)
            values = level * scales[chunk_offset : chunk_offset + count, None]
            out[offset : offset + count * length].view(count, length).scatter_(1, index, values)
            offset += count * length
            chunk_offset += count
            kept_offset += count * kept
        return out
