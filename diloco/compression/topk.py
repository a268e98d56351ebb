"""Chunked top-k sparsification with 2-bit values (SparseLoCo / DeMo style).

The tensor is cut into chunks of ``chunk`` values (the last one may be shorter and keeps
proportionally fewer, at least one). Each chunk keeps the ``k`` values of largest magnitude:
their positions (uint16, ascending) and their values on four levels ``{-1, -1/3, 1/3, 1}``
times the chunk's largest kept magnitude (one fp32 scale a chunk), four values a byte. At
k/chunk = 64/4096 that is 148 bytes for every 16 KiB of fp32, 110 x smaller. What is not sent
is not lost: ``ErrorFeedback`` carries it into the next round.

The average of such contributions is not sparsified again (as SparseLoCo averages them all):
a reducer replies with ``TopKSum``, every position some contribution kept with its exact fp32
value, at most M x k a chunk for M contributions.
"""

from __future__ import annotations

import torch

from diloco.compression.codec import Codec, PayloadError, frombuffer, header_params, register

_LEVELS = torch.tensor([-1.0, -1 / 3, 1 / 3, 1.0])


@register
class TopK(Codec):
    name, codec_id = "topk", 4

    def __init__(self, k: int, chunk: int):  # checked by build_codec (validate_compression_config)
        self.k, self.chunk = k, chunk
        self.align = chunk
        self._reply_codec = TopKSum(chunk)

    def params(self) -> tuple[int, int]:
        return self.k, self.chunk

    @property
    def reply_codec(self) -> Codec:
        return self._reply_codec

    def _layout(self, numel: int) -> list[tuple[int, int, int]]:
        """(number of chunks, chunk length, values kept a chunk) for the full chunks and the tail."""
        full, tail = divmod(numel, self.chunk)
        layout = [(full, self.chunk, self.k)] if full else []
        if tail:
            layout.append((1, tail, min(tail, max(1, -(-self.k * tail // self.chunk)))))
        return layout

    def body_bytes(self, numel: int) -> int:
        chunks = sum(n for n, _, _ in self._layout(numel))
        kept = sum(n * kept for n, _, kept in self._layout(numel))
        return 4 * chunks + 2 * kept + -(-kept // 4)

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
        return (
            torch.cat(scales).numpy().tobytes()
            + torch.cat(positions).to(torch.uint16).numpy().tobytes()
            + packed.numpy().tobytes()
        )

    def _decode(self, body: memoryview, numel: int) -> torch.Tensor:
        layout = self._layout(numel)
        chunks = sum(n for n, _, _ in layout)
        kept_total = sum(n * kept for n, _, kept in layout)
        scales = frombuffer(body[: 4 * chunks], torch.float32)
        positions = frombuffer(body[4 * chunks : 4 * chunks + 2 * kept_total], torch.uint16).to(torch.int64)
        packed = frombuffer(body[4 * chunks + 2 * kept_total :], torch.uint8)
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


@register
class TopKSum(Codec):
    """The exact average of top-k contributions, as a reducer replies with it: in each chunk the
    ``capacity`` positions of largest magnitude (uint16, ascending) and their fp32 values, 6 bytes
    each. ``compress`` sets ``capacity`` to the most non-zeros any chunk of the tensor holds (its
    header says which), so every kept value of every contribution comes back as it was averaged.

    A reply codec, never split: its size follows what it holds, so ``payload_bytes`` is exact for
    one capacity only (``compress`` picks it), and a slice may keep a smaller one than the whole.
    Near dense (capacity above 2/3 of a chunk) it is larger than fp32; at 64 of 4096 that takes
    more than 42 workers."""

    name, codec_id = "topk_sum", 5

    def __init__(self, chunk: int, capacity: int = 1):
        self.chunk, self.capacity = chunk, capacity
        self.align = chunk

    def params(self) -> tuple[int, int]:
        return self.capacity, self.chunk

    def _layout(self, numel: int) -> list[tuple[int, int, int]]:
        full, tail = divmod(numel, self.chunk)
        layout = [(full, self.chunk, min(self.chunk, self.capacity))] if full else []
        if tail:
            layout.append((1, tail, min(tail, self.capacity)))
        return layout

    def body_bytes(self, numel: int) -> int:
        return 6 * sum(n * kept for n, _, kept in self._layout(numel))

    def compress(self, tensor: torch.Tensor) -> bytes:
        flat = tensor.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        full = flat.numel() // self.chunk * self.chunk
        counts = [int(flat[:full].view(-1, self.chunk).count_nonzero(dim=1).max())] if full else []
        if flat.numel() > full:
            counts.append(int(flat[full:].count_nonzero()))
        return Codec.compress(TopKSum(self.chunk, max([1, *counts])), flat)

    def decompress(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        codec_id, capacity, chunk = header_params(payload) or (-1, 0, 0)
        if codec_id == self.codec_id and chunk == self.chunk:
            if not 1 <= capacity <= self.chunk:
                raise PayloadError(f"reply keeps {capacity} values a chunk, not in [1, {self.chunk}]")
            return Codec.decompress(TopKSum(self.chunk, capacity), payload, numel)
        return super().decompress(payload, numel)  # raises, saying what is wrong with it

    def _encode(self, flat: torch.Tensor) -> bytes:
        positions, values, offset = [], [], 0
        for count, length, kept in self._layout(flat.numel()):
            rows = flat[offset : offset + count * length].view(count, length)
            offset += count * length
            index = torch.topk(rows.abs(), kept, dim=1, sorted=False).indices.sort(dim=1).values
            positions.append(index.to(torch.int32).view(-1))
            values.append(rows.gather(1, index).view(-1))
        if not positions:
            return b""
        return torch.cat(positions).to(torch.uint16).numpy().tobytes() + torch.cat(values).numpy().tobytes()

    def _decode(self, body: memoryview, numel: int) -> torch.Tensor:
        layout = self._layout(numel)
        kept_total = sum(n * kept for n, _, kept in layout)
        positions = frombuffer(body[: 2 * kept_total], torch.uint16).to(torch.int64)
        values = frombuffer(body[2 * kept_total :], torch.float32)
        out = torch.zeros(numel, dtype=torch.float32)
        offset = kept_offset = 0
        for count, length, kept in layout:
            index = positions[kept_offset : kept_offset + count * kept].view(count, kept)
            if bool((index >= length).any()) or (kept > 1 and not bool((index[:, 1:] > index[:, :-1]).all())):
                raise PayloadError("payload has top-k positions out of range or out of order")
            chunk_values = values[kept_offset : kept_offset + count * kept].view(count, kept)
            out[offset : offset + count * length].view(count, length).scatter_(1, index, chunk_values)
            offset += count * length
            kept_offset += count * kept
        return out
