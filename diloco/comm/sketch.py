"""A contribution's sketch: a few hundred numbers that stand for its whole vector.

Each value of a contribution (its tensors taken as one flat vector, in order) is added, with a
sign, to one of ``SIZE`` buckets; bucket and sign are a hash of the value's position in the flat
vector (a count sketch). The sketch is linear (the sketch of a sum is the sum of the sketches, and
the sketches of a vector's slices, each hashed at its own offset, add up to the whole's), and the
cosine of two sketches estimates the cosine of the two vectors (unbiased; its spread is about
``1 / sqrt(SIZE)``). So peers that each see a slice of a contribution, or none of it, can judge
whole contributions by their sketches alone (``verdicts.py``): every peer computes the same
verdicts from the same declared sketches.

The hash is fixed (the same projection in every round and run): a contribution can then be
compared with earlier rounds' (a replay). Computing one costs a pass over the vector in chunks of
``_CHUNK`` values (a few int64 temporaries of that length).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

SIZE = 2048  # numbers in a sketch (8 kB on the wire): a cosine of two is the vectors' within ~0.02 (1 sigma)
_CHUNK = 1 << 20
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (the golden-ratio multiplier)
_MIX2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64 (splitmix64's)


def _buckets_and_signs(start: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The bucket (0..SIZE-1) and sign (+1/-1) of the flat positions ``start .. start + count - 1``:
    splitmix64's finalizer of the position (int64 arithmetic wraps the same on every machine)."""
    x = torch.arange(start, start + count, dtype=torch.int64, device=device) * _MIX
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX2
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    buckets = (x & (SIZE - 1)).long()
    signs = ((x >> 40) & 1).to(torch.float32) * 2 - 1
    return buckets, signs


def sketch_of(tensors: Sequence[torch.Tensor], *, offset: int = 0) -> torch.Tensor:
    """The sketch (float64, ``SIZE`` numbers, on the CPU) of ``tensors`` taken as one flat vector
    that starts at position ``offset`` of the whole (0: the whole contribution)."""
    total = torch.zeros(SIZE, dtype=torch.float64)
    position = offset
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            chunk = flat[start : start + _CHUNK].float()
            buckets, signs = _buckets_and_signs(position + start, chunk.numel(), chunk.device)
            part = torch.zeros(SIZE, dtype=torch.float64, device=chunk.device)
            part.index_add_(0, buckets, (chunk * signs).double())
            total += part.cpu()
        position += flat.numel()
    return total


def encode(sketch: torch.Tensor) -> bytes:
    """A sketch as it travels (float32 bytes)."""
    return sketch.to(torch.float32).numpy().tobytes()


def decode(data: object) -> torch.Tensor | None:
    """The sketch in ``data`` (what ``encode`` made), as float64; None for anything else (a sketch
    of the wrong size, or one that is not finite)."""
    if not isinstance(data, bytes | bytearray) or len(data) != SIZE * 4:
        return None
    sketch = torch.from_numpy(np.frombuffer(bytes(data), dtype=np.float32).copy()).double()
    return sketch if bool(torch.isfinite(sketch).all()) else None


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine of two sketches (0 when either is zero)."""
    norms = float(a.norm()) * float(b.norm())
    return float(a @ b) / norms if norms > 0 and math.isfinite(norms) else 0.0
