"""A worker's state laid out for a download in parts from several peers at once.

The state's tensors are read as one run of bytes, end to end, cut in parts of one size. A
``Manifest`` names the state's structure (its tensors left out), each tensor's dtype and shape,
and each part's sha256: peers that serve the same state serve the same manifest, so a receiver
takes one that two peers agree on, checks every part against it, and writes each part straight
into tensors it allocated from it. A ``Plan`` tracks a download: which parts are still missing,
which peer fetches which, which peers served a bad part (they fetch nothing more). Nothing here
knows the transport: ``state_swarm.py`` runs a download over hivemind.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

MARK = "\x00diloco.tensor:"  # stands for the i-th tensor in a state's structure
MIN_PART_BYTES, MAX_PART_BYTES = 256, 1 << 20  # a part fits a p2p message (4 MiB) with room to spare
PARTS_AT_LEAST = 64  # a small state is still cut in about this many parts, so that several peers can share it


def flatten(state: object) -> tuple[object, list[torch.Tensor]]:
    """(the structure of ``state`` with each tensor replaced by ``MARK`` + its index, the tensors)."""
    tensors: list[torch.Tensor] = []

    def walk(value: object) -> object:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return f"{MARK}{len(tensors) - 1}"
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(walk(item) for item in value)
        return value

    return walk(state), tensors


def unflatten(skeleton: object, tensors: Sequence[torch.Tensor]) -> object:
    """The state ``flatten`` took apart: ``skeleton`` with its marks replaced by ``tensors``."""
    if isinstance(skeleton, str) and skeleton.startswith(MARK):
        return tensors[int(skeleton[len(MARK) :])]
    if isinstance(skeleton, dict):
        return {key: unflatten(item, tensors) for key, item in skeleton.items()}
    if isinstance(skeleton, list | tuple):
        return type(skeleton)(unflatten(item, tensors) for item in skeleton)
    return skeleton


def byte_views(tensors: Iterable[torch.Tensor]) -> list[memoryview]:
    """Each tensor's bytes, without a copy where it is contiguous (the receiver's always are)."""
    return [memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()) for t in tensors]


def _slices(views: Sequence[memoryview], start: int, end: int) -> Iterator[memoryview]:
    """The pieces of ``views`` (their bytes end to end) that bytes ``start`` to ``end`` cover."""
    offset = 0
    for view in views:
        size = view.nbytes
        if offset + size > start and offset < end:
            yield view[max(0, start - offset) : min(size, end - offset)]
        offset += size
        if offset >= end:
            return


def read_range(views: Sequence[memoryview], start: int, end: int) -> bytes:
    """Bytes ``start`` to ``end`` of ``views`` (their bytes end to end)."""
    return b"".join(_slices(views, start, end))


def write_range(views: Sequence[memoryview], start: int, data: bytes | memoryview) -> None:
    """Write ``data`` at byte ``start`` of ``views`` (their bytes end to end)."""
    data, done = memoryview(data), 0
    for piece in _slices(views, start, start + data.nbytes):
        piece[:] = data[done : done + piece.nbytes]
        done += piece.nbytes


def part_bytes_for(total: int) -> int:
    """The size of a part of a state of ``total`` bytes: a multiple of 256 bytes, at most 1 MiB, at
    least ``PARTS_AT_LEAST`` parts where the state is big enough."""
    wanted = -(-total // PARTS_AT_LEAST)
    return min(MAX_PART_BYTES, max(MIN_PART_BYTES, -(-wanted // MIN_PART_BYTES) * MIN_PART_BYTES))


@dataclass(frozen=True)
class Manifest:
    """What a state is, part by part: ``skeleton`` (its structure as ``torch.save`` writes it,
    each tensor a mark), each tensor's dtype (its name in torch) and shape, the part size, and
    each part's sha256."""

    skeleton: bytes
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    part_bytes: int
    hashes: tuple[bytes, ...]
    total_bytes: int = field(init=False)

    def __post_init__(self):
        sizes = (_numel(shape) * _dtype(name).itemsize for name, shape in zip(self.dtypes, self.shapes, strict=True))
        object.__setattr__(self, "total_bytes", sum(sizes))
        if self.part_bytes <= 0 or len(self.hashes) != -(-self.total_bytes // self.part_bytes):
            raise ValueError("a manifest whose parts do not cover its tensors")

    @property
    def parts(self) -> int:
        return len(self.hashes)

    def span(self, part: int) -> tuple[int, int]:
        """The bytes part ``part`` covers: [start, end)."""
        start = part * self.part_bytes
        return start, min(self.total_bytes, start + self.part_bytes)

    def holds(self, part: int, data: bytes | memoryview) -> bool:
        """Whether ``data`` is part ``part`` of this state."""
        return 0 <= part < self.parts and hashlib.sha256(data).digest() == self.hashes[part]

    def digest(self) -> str:
        """One hash of the whole manifest: two peers serve the same state when theirs are equal."""
        h = hashlib.sha256(self.skeleton)
        h.update(repr((self.dtypes, self.shapes, self.part_bytes)).encode())
        for part_hash in self.hashes:
            h.update(part_hash)
        return h.hexdigest()

    def allocate(self) -> list[torch.Tensor]:
        """Empty tensors to receive the state in, in shared memory (the averager's process hands
        them to the worker's without a copy)."""
        return [torch.empty(shape, dtype=_dtype(name)).share_memory_() for name, shape in zip(self.dtypes, self.shapes)]

    def state(self, tensors: Sequence[torch.Tensor]) -> object:
        """The state, its tensors ``tensors`` (filled)."""
        return unflatten(torch.load(io.BytesIO(self.skeleton), weights_only=True), tensors)

    def to_wire(self) -> dict:
        return {"skeleton": self.skeleton, "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes],
                "part_bytes": self.part_bytes, "hashes": list(self.hashes)}  # fmt: skip

    @classmethod
    def from_wire(cls, wire: dict) -> Manifest:
        """The manifest a peer sent; ``ValueError`` where it is not one."""
        try:
            return cls(bytes(wire["skeleton"]), tuple(str(d) for d in wire["dtypes"]),
                       tuple(tuple(int(n) for n in s) for s in wire["shapes"]), int(wire["part_bytes"]),
                       tuple(bytes(h) for h in wire["hashes"]))  # fmt: skip
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"not a state manifest: {error!r}") from None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _numel(shape: Sequence[int]) -> int:
    if any(n < 0 for n in shape):
        raise ValueError(f"a negative size in shape {tuple(shape)}")
    count = 1
    for n in shape:
        count *= n
    return count


def manifest_of(state: object) -> Manifest:
    """The manifest of ``state`` (read at once: the caller holds it still)."""
    skeleton, tensors = flatten(state)
    buffer = io.BytesIO()
    torch.save(skeleton, buffer)
    views = byte_views(tensors)
    total = sum(v.nbytes for v in views)
    part_bytes = part_bytes_for(total)
    hashes = []
    for start in range(0, total, part_bytes):
        h = hashlib.sha256()
        for piece in _slices(views, start, start + part_bytes):
            h.update(piece)
        hashes.append(h.digest())
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in tensors)
    return Manifest(buffer.getvalue(), dtypes, tuple(tuple(t.shape) for t in tensors), part_bytes, tuple(hashes))


def agreed(served: dict[str, tuple[Manifest, bytes]], order: Sequence[str]) -> tuple[Manifest, bytes, list[str]]:
    """(manifest, metadata, its peers) of the state the most peers in ``served`` serve (peer ->
    (manifest, the offer's metadata as sent)); on a tie, that of the first in ``order``. A
    manifest that only one peer serves is that peer's word alone: the caller checks the state
    it makes (its params' digest) once downloaded."""
    by_key: dict[tuple[str, bytes], list[str]] = {}
    for peer in order:
        if peer in served:
            manifest, metadata = served[peer]
            by_key.setdefault((manifest.digest(), metadata), []).append(peer)
    peers = max(by_key.values(), key=len)  # the first of the largest, in ``order``
    manifest, metadata = served[peers[0]]
    return manifest, metadata, peers


class Plan:
    """Which parts of a download are still missing, and which peer fetches which: each takes a
    run of at most ``span`` missing parts that nobody fetches; a part that did not come goes
    back to the missing; a peer that served a bad part is refused (it takes nothing more)."""

    def __init__(self, parts: int, *, span: int):
        self.parts, self.span = parts, span
        self.missing: set[int] = set(range(parts))
        self.in_flight: set[int] = set()
        self.refused: set[str] = set()
        self.served: dict[str, int] = {}  # peer -> how many good parts it served

    @property
    def done(self) -> bool:
        return not self.missing

    def take(self, peer: str) -> range | None:
        """The next run of parts ``peer`` fetches (marked in flight), or None: nothing is left
        that nobody fetches, or ``peer`` is refused."""
        if peer in self.refused:
            return None
        free = sorted(self.missing - self.in_flight)
        if not free:
            return None
        first = free[0]
        stop = first + 1
        while stop < self.parts and stop - first < self.span and stop in self.missing and stop not in self.in_flight:
            stop += 1
        self.in_flight.update(range(first, stop))
        return range(first, stop)

    def landed(self, part: int, peer: str) -> None:
        """Part ``part`` came from ``peer`` and was good."""
        self.missing.discard(part)
        self.in_flight.discard(part)
        self.served[peer] = self.served.get(peer, 0) + 1

    def missed(self, parts: Iterable[int]) -> None:
        """Parts that did not come (a broken stream, a stale offer): missing again."""
        self.in_flight.difference_update(parts)

    def refuse(self, peer: str, parts: Iterable[int]) -> None:
        """``peer`` served a bad part: it fetches nothing more, and ``parts`` it had are missing again."""
        self.refused.add(peer)
        self.missed(parts)
