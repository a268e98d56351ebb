"""Atomic save / load of everything a worker needs to resume, written off the training loop.

A worker hands its state to a ``CheckpointWriter`` after an outer round and goes on training:
the writer copies the state's tensors (to host memory: a snapshot, so later steps cannot change
what is written) and writes that snapshot from a thread of its own. It never runs two writes at
once: a save that comes while the previous one is still writing waits for it. At start-up the
worker reads its newest whole checkpoint (``read_newest``; which state it resumes from when its
own newest is damaged: resume.py). The state is an opaque dict (model and optimizer state dicts,
``capture_rng_state()``, sampler position, round, ...).

Layout: ``<directory>/worker-<i>/round-<r:06d>.pt``. Each file is

    MAGIC (8 bytes) | payload length (8 bytes, little-endian) | sha256 of payload (32 bytes) | payload

where the payload is ``torch.save(state)``, streamed into a temp file in the same folder while its
digest is computed; the header is filled in after, then the file is fsynced, renamed over its final
name (atomic on POSIX) and the folder fsynced. So a crash at any moment (``kill -9`` in the middle
of a write included) leaves either the old set of checkpoints or the new one, never a half file
under a final name. Loading checks length and digest, so a truncated or bit-flipped file is skipped
(and the previous checkpoint, or another worker's newer one, is used instead: resume.py).
Leftover temp files (names starting with ``.``) are ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import random
import re
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.core.host_copies import state_to_cpu

logger = logging.getLogger(__name__)

MAGIC = b"DILOCK01"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 digest
_NAME_RE = re.compile(r"^round-(\d+)\.pt$")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is truncated, bit-flipped or not ours."""


def checkpoint_folder(directory: Path, worker_index: int) -> Path:
    """The folder of worker ``worker_index``'s checkpoints (and of what else it keeps across a restart)."""
    return Path(directory) / f"worker-{worker_index}"


def list_checkpoints(directory: Path, worker_index: int) -> list[tuple[int, Path]]:
    """(round, path) of this worker's checkpoint files, oldest first; temp files are not listed."""
    folder = checkpoint_folder(directory, worker_index)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _NAME_RE.match(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _fsync_dir(folder: Path) -> None:
    # The rename is only durable once the directory entry itself reaches the disk.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A binary file that also hashes and counts what is written to it."""

    def __init__(self, file, on_write: Callable[[int], None] | None = None):
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


def save_checkpoint(
    directory: Path,
    worker_index: int,
    round_index: int,
    state: dict[str, Any],
    *,
    keep: int = 2,
    on_write: Callable[[int], None] | None = None,
) -> Path:
    """Write ``state`` atomically as this worker's checkpoint for ``round_index``; keep the newest ``keep``.

    The payload is streamed to the temp file (no serialized copy of the state in memory);
    ``on_write(bytes_so_far)`` is called after each piece (tests use it to crash mid-write).
    """
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    if round_index < 0:
        raise ValueError(f"round_index must be >= 0, got {round_index}")
    folder = checkpoint_folder(directory, worker_index)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"round-{round_index:06d}.pt"

    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * _HEADER.size)  # filled in once the payload's length and digest are known
            payload = _HashingWriter(f, on_write)
            torch.save(state, payload)
            f.seek(0)
            f.write(_HEADER.pack(MAGIC, payload.length, payload.digest.digest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    logger.debug("saved checkpoint %s (%d bytes)", final, payload.length)

    for _, old in list_checkpoints(directory, worker_index)[:-keep]:
        old.unlink(missing_ok=True)
        logger.debug("pruned checkpoint %s", old)
    return final


class CheckpointWriter:
    """This worker's checkpoints, written in the background: ``save`` takes a snapshot of the
    state and returns; a thread writes it (``save_checkpoint``). One write at a time: ``save``
    waits for the previous write first. A write that failed (a full disk) raises its error from
    the next ``save`` or from ``close``, which waits for the last write: the newest checkpoint is
    on disk when ``close`` returns."""

    def __init__(
        self, directory: Path, worker_index: int, *, keep: int = 2, on_write: Callable[[int], None] | None = None
    ):
        self.directory, self.worker_index, self.keep = Path(directory), worker_index, keep
        self._on_write = on_write  # save_checkpoint's
        # a process killed while writing leaves its temp file: the worker's next life removes it
        for stale in checkpoint_folder(self.directory, worker_index).glob(".round-*.tmp"):
            stale.unlink(missing_ok=True)
            logger.info("removed %s, a checkpoint an earlier process did not finish writing", stale)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_write_s = 0.0  # how long the last finished write took, in its thread

    def save(self, round_index: int, state: dict[str, Any]) -> None:
        self.wait()
        copied = state_to_cpu(state, copy=True)  # what later steps change is not in it
        self._thread = threading.Thread(
            target=self._write, args=(round_index, copied), name="diloco-checkpoint", daemon=False
        )
        self._thread.start()

    def wait(self) -> None:
        """Until the write in progress (if any) is on disk; raises the error of one that failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    close = wait

    def _write(self, round_index: int, state: dict[str, Any]) -> None:
        started = time.perf_counter()
        _yield_cpu_to_training()
        try:
            save_checkpoint(
                self.directory, self.worker_index, round_index, state, keep=self.keep, on_write=self._on_write
            )
        except BaseException as exc:  # handed to the training thread at its next save or at close
            self._error = exc
        self.last_write_s = time.perf_counter() - started


def _yield_cpu_to_training() -> None:
    """The calling thread at the lowest CPU priority (Linux: a thread's nice value is its own):
    a background write takes the cores only when training leaves them idle."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load one checkpoint file to CPU; raise ``CorruptCheckpointError`` if it fails verification."""
    data = Path(path).read_bytes()
    if len(data) < _HEADER.size:
        raise CorruptCheckpointError(f"{path}: {len(data)} bytes, shorter than the header")
    magic, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"{path}: not a diloco checkpoint (magic {magic!r})")
    payload = memoryview(data)[_HEADER.size :]
    if len(payload) != length:
        raise CorruptCheckpointError(f"{path}: payload is {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpointError(f"{path}: sha256 mismatch")
    # Our own files, verified above: full unpickling is needed for RNG states and optimizer extras.
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)


def read_newest(
    directory: Path, worker_index: int, *, newer_than: int = -1
) -> tuple[tuple[int, Path, dict[str, Any]] | None, dict[Path, str]]:
    """The newest of this worker's checkpoints past round ``newer_than`` that reads whole, as
    (round, path, state), or None; and each newer one that did not (truncated, bit-flipped,
    unreadable, gone), with what is wrong with it."""
    damaged: dict[Path, str] = {}
    for round_index, path in reversed(list_checkpoints(directory, worker_index)):
        if round_index <= newer_than:
            break
        try:
            return (round_index, path, read_checkpoint(path)), damaged
        except Exception as exc:  # corrupt, truncated, or unreadable: the previous one may do
            damaged[path] = str(exc).removeprefix(f"{path}: ")
    return None, damaged


def load_latest_checkpoint(directory: Path, worker_index: int) -> dict[str, Any] | None:
    """Newest valid checkpoint of this worker, skipping corrupt ones with a warning; None if there is none."""
    found, damaged = read_newest(directory, worker_index)
    for path, reason in damaged.items():
        logger.warning("skipping unusable checkpoint %s: %s", path, reason)
    if found is None:
        return None
    logger.info("loaded checkpoint %s", found[1])
    return found[2]


def capture_rng_state() -> dict[str, Any]:
    """States of python ``random``, numpy's global RNG and torch's CPU (and CUDA, if present) RNGs."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``; CUDA states are restored only when the device count matches."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    cuda_states = state.get("torch_cuda")
    if cuda_states is not None and torch.cuda.is_available():
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
        else:
            logger.warning(
                "not restoring CUDA RNG: checkpoint has %d devices, this machine %d",
                len(cuda_states),
                torch.cuda.device_count(),
            )
