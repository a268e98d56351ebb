"""Blockwise absmax quantization to 8 or 4 bits.

Values are cut into blocks of ``block_size``; each block stores one fp32 scale (its largest
magnitude over the top level) and every value as the nearest level in ``[-levels, levels]``:
127 levels a side in one byte, or 7 levels a side in a nibble, two values a byte. A block's
error is at most half its scale. Vectorised over all blocks at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diloco.compression.codec import Codec, frombuffer, register


class _Blockwise(Codec):
    levels: int  # quantization levels on each side of zero

    def __init__(self, block_size: int):  # checked by build_codec (validate_compression_config)
        self.block_size = self.align = block_size

    def params(self) -> tuple[int, int]:
        return self.block_size, 0

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def body_bytes(self, numel: int) -> int:
        return 4 * self._blocks(numel) + self._code_bytes(numel)

    def _quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 scale per block, integer level per value as int8)."""
        numel, blocks = flat.numel(), self._blocks(flat.numel())
        padded = F.pad(flat, (0, blocks * self.block_size - numel)).view(blocks, self.block_size)
        scales = padded.abs().amax(dim=1) / self.levels
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(padded / divisor[:, None]).clamp_(-self.levels, self.levels)
        return scales, codes.to(torch.int8).view(-1)[:numel]

    def _dequantize(self, scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        numel = codes.numel()
        blocks = scales.numel()
        padded = F.pad(codes.to(torch.float32), (0, blocks * self.block_size - numel)).view(blocks, self.block_size)
        return (padded * scales[:, None]).view(-1)[:numel]

    def _encode(self, flat: torch.Tensor) -> bytes:
        scales, codes = self._quantize(flat)
        return scales.numpy().tobytes() + self._pack(codes).numpy().tobytes()

    def _decode(self, body: memoryview, numel: int) -> torch.Tensor:
        scale_bytes = 4 * self._blocks(numel)
        scales = frombuffer(body[:scale_bytes], torch.float32)
        codes = self._unpack(frombuffer(body[scale_bytes:], torch.uint8), numel)
        return self._dequantize(scales, codes)

    def _code_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        raise NotImplementedError


@register
class Int8(_Blockwise):
    """One signed byte a value (levels -127..127) and one fp32 scale a block."""

    name, codec_id, levels = "int8", 2, 127

    def _code_bytes(self, numel: int) -> int:
        return numel

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.uint8)

    def _unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return packed.view(torch.int8)


@register
class Int4(_Blockwise):
    """Half a byte a value (levels -7..7, stored as 1..15, two a byte) and one fp32 scale a block."""

    name, codec_id, levels = "int4", 3, 7

    def _code_bytes(self, numel: int) -> int:
        return -(-numel // 2)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        nibbles = (codes + 8).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = F.pad(nibbles, (0, 1), value=8)
        pairs = nibbles.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)

    def _unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        low, high = packed & 0x0F, packed >> 4
        nibbles = torch.stack([low, high], dim=1).view(-1)[:numel]
        return nibbles.to(torch.int8) - 8
