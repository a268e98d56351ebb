"""One checkpoint file: its format, written in pieces straight from the live state, and read back.

Every file is

    MAGIC (8 bytes) | body length (8 bytes, little-endian) | sha256 of the body (32 bytes) | body

``DILOCK02`` (written now): the body is

    skeleton length (8 bytes, little-endian) | skeleton | every tensor's bytes, one after the other

where the skeleton is ``torch.save`` of the state with each tensor replaced by a ``Stored``
placeholder (its group, place, dtype and shape), and the tensors follow raw, in chunks. A tensor
the state holds twice (the same memory: tied weights, a model's params that are the global params)
is written once. ``DILOCK01`` (older files, still read): the body is ``torch.save(state)`` whole.

The tensors are not copied before they are written: a ``LiveState`` names, for each top-level part
of the state, until when its tensors stay as they are (``live``: a *group*), and the writer writes
the groups in order, releasing each once it is on its way to disk (``LiveState.wait``): the inner
optimizer's step waits for the model and its moments, the next round's end for the global params
and the outer momentum. Parts without a group are copied when the ``LiveState`` is made (small
things: RNG states, the data position, counters). So a worker never holds a second copy of its
model state for a checkpoint; at most one chunk of a tensor on its way from a GPU.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from diloco.core.host_copies import state_to_cpu

MAGIC_V1 = b"DILOCK01"
MAGIC = b"DILOCK02"
HEADER = struct.Struct("<8sQ32s")  # magic, body length, sha256 of the body
_LENGTH = struct.Struct("<Q")
CHUNK_BYTES = 16 << 20  # a tensor is written and read in pieces of at most this many bytes
GROUPS = ("step", "round")  # the order groups are written in: what changes soonest first


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is truncated, bit-flipped or not ours."""


@dataclass(frozen=True)
class Stored:
    """Where a tensor of the state is in the file: the ``place``-th tensor of group ``group``."""

    group: int
    place: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class LiveState:
    """A state split into its skeleton and its tensors, each tensor in the group of its top-level
    part (``live[key]``, one of ``GROUPS``; a part not named is copied now and written first).
    ``live=None``: nothing changes while it is written (a synchronous write), so nothing is copied."""

    def __init__(self, state: Mapping[str, Any], live: Mapping[str, str] | None = None):
        self.tensors: list[list[torch.Tensor]] = [[] for _ in GROUPS]
        self._seen: dict[tuple, Stored] = {}
        skeleton = {}
        groups = {key: GROUPS[0] if live is None else live.get(key) for key in state}
        # the latest group first: a tensor two parts hold (a model's params that are the global
        # params) is written with the part that keeps it longest
        for key in sorted(state, key=lambda k: -1 if groups[k] is None else GROUPS.index(groups[k]), reverse=True):
            value, group = state[key], groups[key]
            if group is None:
                value, group = state_to_cpu(value, copy=True), GROUPS[0]
            skeleton[key] = self._replaced(value, GROUPS.index(group))
        self.skeleton = {key: skeleton[key] for key in state}
        self._written = [threading.Event() for _ in GROUPS]
        self.on_release: Callable[[int], object] | None = None  # called in the writer's thread, with the group

    def _replaced(self, value: Any, group: int) -> Any:
        if isinstance(value, torch.Tensor):
            value = value.detach()
            key = _memory_key(value)
            if key not in self._seen:
                self._seen[key] = Stored(group, len(self.tensors[group]), value.dtype, tuple(value.shape))
                self.tensors[group].append(value)
            return self._seen[key]
        if isinstance(value, dict):
            return {k: self._replaced(v, group) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._replaced(v, group) for v in value)
        return value

    def release(self, group: int) -> None:
        """Group ``group`` (and every one before it) is written: what changes it may go on."""
        for event in self._written[: group + 1]:
            event.set()
        if self.on_release is not None:
            self.on_release(group)

    def release_all(self) -> None:
        self.release(len(GROUPS) - 1)

    def forget(self) -> None:
        """Let go of the tensors (once written, or once the write failed)."""
        self.tensors, self.skeleton = [[] for _ in GROUPS], {}

    def waiting(self, group: str) -> bool:
        """Whether group ``group`` is still being written."""
        return not self._written[GROUPS.index(group)].is_set()

    def wait(self, group: str) -> None:
        """Until group ``group`` is written (a write that failed releases every group)."""
        self._written[GROUPS.index(group)].wait()


def _memory_key(tensor: torch.Tensor) -> tuple:
    """Equal for two tensors that are the same values in the same memory."""
    storage = tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)
    return (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)


class HashingWriter:
    """A binary file that also hashes and counts what is written to it."""

    def __init__(self, file: BinaryIO, on_write: Callable[[int], None] | None = None):
        self.file, self.digest, self.length, self._on_write = file, hashlib.sha256(), 0, on_write

    def write(self, data) -> int:
        written = self.file.write(data)
        self.digest.update(memoryview(data)[:written])
        self.length += written
        if self._on_write is not None:
            self._on_write(self.length)
        return written

    def flush(self) -> None:
        self.file.flush()


def write_file(file: BinaryIO, state: LiveState, *, on_write: Callable[[int], None] | None = None) -> None:
    """The whole file into ``file`` (open for writing, at its start): the body streamed from the
    live tensors, group by group (each released once written), then the header."""
    file.write(b"\0" * HEADER.size)  # filled in once the body's length and digest are known
    body = HashingWriter(file, on_write)
    skeleton = io.BytesIO()
    torch.save(state.skeleton, skeleton)
    body.write(_LENGTH.pack(skeleton.getbuffer().nbytes))
    body.write(skeleton.getbuffer())
    for group, tensors in enumerate(state.tensors):
        for tensor in tensors:
            _write_tensor(body, tensor)
        state.release(group)
    file.seek(0)
    file.write(HEADER.pack(MAGIC, body.length, body.digest.digest()))


def _write_tensor(out: HashingWriter, tensor: torch.Tensor) -> None:
    flat = (tensor if tensor.is_contiguous() else tensor.contiguous()).reshape(-1)
    per_chunk = max(1, CHUNK_BYTES // max(1, tensor.element_size()))
    for start in range(0, flat.numel(), per_chunk):
        piece = flat[start : start + per_chunk]
        if piece.device.type != "cpu":
            piece = piece.cpu()  # one chunk at a time off the device
        out.write(memoryview(piece.view(torch.uint8).numpy()))


def read_file(path: Path) -> dict[str, Any]:
    """The state in one checkpoint file, on the CPU; ``CorruptCheckpointError`` when it is truncated,
    bit-flipped or not a checkpoint. The tensors are read straight into their own memory."""
    with open(path, "rb") as file:
        header = file.read(HEADER.size)
        if len(header) < HEADER.size:
            raise CorruptCheckpointError(f"{path}: {len(header)} bytes, shorter than the header")
        magic, length, digest = HEADER.unpack(header)
        if magic == MAGIC_V1:
            return _read_v1(path, file.read(), length, digest)
        if magic != MAGIC:
            raise CorruptCheckpointError(f"{path}: not a diloco checkpoint (magic {magic!r})")
        if (size := os.fstat(file.fileno()).st_size - HEADER.size) != length:
            raise CorruptCheckpointError(f"{path}: payload is {size} bytes, header says {length}")
        body = _HashingReader(file, path, length)
        skeleton = torch.load(io.BytesIO(body.read(body.read_length())), map_location="cpu", weights_only=False)
        tensors = _read_tensors(body, skeleton)
        body.check_end(digest)
    return _filled(skeleton, tensors)


def _read_v1(path: Path, payload: bytes, length: int, digest: bytes) -> dict[str, Any]:
    if len(payload) != length:
        raise CorruptCheckpointError(f"{path}: payload is {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpointError(f"{path}: sha256 mismatch")
    # Our own files, verified above: full unpickling is needed for RNG states and optimizer extras.
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)


class _HashingReader:
    """The body of a file, read in order and hashed; never past its declared length."""

    def __init__(self, file: BinaryIO, path: Path, length: int):
        self.file, self.path, self.left, self.digest = file, path, length, hashlib.sha256()

    def read_length(self) -> int:
        return _LENGTH.unpack(self.read(_LENGTH.size))[0]

    def read(self, size: int) -> bytes:
        data = self.file.read(min(size, max(self.left, 0)))
        self._took(data, size)
        return data

    def read_into(self, buffer: memoryview) -> None:
        size = len(buffer)
        got = self.file.readinto(buffer[: min(size, max(self.left, 0))]) or 0
        self._took(buffer[:got], size)

    def _took(self, data, wanted: int) -> None:
        if len(data) < wanted:
            raise CorruptCheckpointError(f"{self.path}: truncated (the body ends early)")
        self.digest.update(data)
        self.left -= len(data)

    def check_end(self, digest: bytes) -> None:
        if self.left != 0 or self.file.read(1):
            raise CorruptCheckpointError(f"{self.path}: payload length differs from the header's")
        if self.digest.digest() != digest:
            raise CorruptCheckpointError(f"{self.path}: sha256 mismatch")


def _read_tensors(body: _HashingReader, skeleton: Any) -> list[list[torch.Tensor]]:
    stored = sorted(set(_placeholders(skeleton)), key=lambda s: (s.group, s.place))
    tensors: list[list[torch.Tensor]] = [[] for _ in GROUPS]
    for item in stored:
        tensor = torch.empty(item.shape, dtype=item.dtype)
        if tensor.numel():
            flat = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(flat), CHUNK_BYTES):
                body.read_into(flat[start : start + CHUNK_BYTES])
        tensors[item.group].append(tensor)
    return tensors


def _placeholders(value: Any) -> Sequence[Stored]:
    if isinstance(value, Stored):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _placeholders(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _placeholders(v)]
    return []


def _filled(value: Any, tensors: list[list[torch.Tensor]]) -> Any:
    if isinstance(value, Stored):
        return tensors[value.group][value.place]
    if isinstance(value, dict):
        return {k: _filled(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_filled(v, tensors) for v in value)
    return value
