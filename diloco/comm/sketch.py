"""A contribution's sketch: two thousand numbers that stand for its whole vector.

Each value of a contribution (its tensors taken as one flat vector, in order) is added, with a
sign, to one of ``SIZE`` buckets; bucket and sign are a hash of the value's position in the flat
vector (a count sketch, hashed by blocks of ``BLOCK`` positions: ``sketch_of``). The sketch is
linear (the sketch of a sum is the sum of the sketches, and the sketches of a vector's slices,
each hashed at its own offset, add up to the whole's), and the cosine of two sketches estimates
the cosine of the two vectors (its spread is about ``1 / sqrt(SIZE)``). So peers that each see a
slice of a contribution, or none of it, can judge whole contributions by their sketches alone
(``verdicts.py``): every peer computes the same verdicts from the same declared sketches.

The hash is fixed (the same projection in every round and run): a contribution can then be
compared with earlier rounds' (a replay). Computing one costs a pass over the vector in chunks of
``_CHUNK`` values (a signed copy of a chunk, and a 4 MB table): about 1.2 ns a value on one core.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

SIZE = 2048  # numbers in a sketch (8 kB on the wire): a cosine of two is the vectors' within ~0.02 (1 sigma)
BLOCK = 256  # positions hashed together: a block's values land in BLOCK buckets in a row, from its shift
_CHUNK = 1 << 20  # values hashed at a time (a multiple of BLOCK)
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (the golden-ratio multiplier)
_MIX2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64 (splitmix64's)


def _mixed(x: torch.Tensor, salt: int) -> torch.Tensor:
    """splitmix64's finalizer of ``x + salt`` (int64 arithmetic wraps the same on every machine)."""
    x = (x + salt) * _MIX
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX2
    return x ^ ((x >> 27) & ((1 << 37) - 1))


def _signs(x: torch.Tensor) -> torch.Tensor:
    return ((x >> 40) & 1).to(torch.float32) * 2 - 1


_LANE_SIGNS = _signs(_mixed(torch.arange(BLOCK, dtype=torch.int64), 1))  # a sign per position in a block


def _block_hashes(first: int, count: int) -> torch.Tensor:
    """Each block's row of the table (blocks ``first .. first + count - 1``): its shift
    (0..SIZE-1), plus SIZE where its sign is negative."""
    mixed = _mixed(torch.arange(first, first + count, dtype=torch.int64), 2)
    return (mixed & (SIZE - 1)) + SIZE * ((mixed >> 40) & 1)


def sketch_of(tensors: Sequence[torch.Tensor], *, offset: int = 0) -> torch.Tensor:
    """The sketch (float64, ``SIZE`` numbers, on the CPU) of ``tensors`` taken as one flat vector
    that starts at position ``offset`` of the whole (0: the whole contribution).

    The positions come in blocks of ``BLOCK``: position ``b * BLOCK + j`` goes to bucket
    ``(shift[b] + j) % SIZE`` with sign ``sign[b] * lane_sign[j]`` (hashes drawn per block, so two
    positions of one block never share a bucket, and those of two blocks do at random). Whole
    blocks are added as rows into a table with one row per shift and sign (``2 SIZE`` x ``BLOCK``,
    4 MB), whose rows go to their buckets once: a pass over the values."""
    table = torch.zeros(2 * SIZE, BLOCK, dtype=torch.float32)
    position = offset
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        done = 0
        while done < flat.numel():
            start = position + done
            ahead = min(flat.numel() - done, _CHUNK - start % BLOCK)
            _add(table, flat[done : done + ahead].float().cpu(), start)
            done += ahead
        position += flat.numel()
    rows = torch.arange(2 * SIZE)
    buckets = (rows[:, None] % SIZE + torch.arange(BLOCK)[None, :]) % SIZE
    signed = table.double() * torch.where(rows < SIZE, 1.0, -1.0).double()[:, None]
    return torch.zeros(SIZE, dtype=torch.float64).index_add_(0, buckets.reshape(-1), signed.reshape(-1))


def _add(table: torch.Tensor, values: torch.Tensor, start: int) -> None:
    """Add ``values`` (flat positions ``start ..``) into ``table``: whole blocks as rows, a block's
    head or tail position by position."""
    head = min((-start) % BLOCK, values.numel())
    whole = (values.numel() - head) // BLOCK * BLOCK
    for piece, at in ((values[:head], start), (values[head + whole :], start + head + whole)):
        if piece.numel():
            lanes = torch.arange(at, at + piece.numel()) % BLOCK
            table[int(_block_hashes(at // BLOCK, 1))].index_add_(0, lanes, piece * _LANE_SIGNS[lanes])
    if whole:
        blocks = values[head : head + whole].view(-1, BLOCK) * _LANE_SIGNS
        table.index_add_(0, _block_hashes((start + head) // BLOCK, blocks.shape[0]), blocks)


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
    """The cosine of two sketches (0 when either is zero), summed exactly (``math.fsum``): the
    same bits on every machine, whatever its vector instructions."""
    x, y = a.tolist(), b.tolist()
    norms = math.sqrt(math.fsum(v * v for v in x)) * math.sqrt(math.fsum(v * v for v in y))
    return math.fsum(u * v for u, v in zip(x, y)) / norms if norms > 0 and math.isfinite(norms) else 0.0
