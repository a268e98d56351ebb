"""Atomic save / load of everything a worker needs to resume.

A worker calls ``save_checkpoint(run_dir / "checkpoints", i, round, state)`` after an outer round and
``load_latest_checkpoint(run_dir / "checkpoints", i)`` at start-up. The state is an opaque dict (model and
optimizer state dicts, ``capture_rng_state()``, sampler position, round, ...).

Layout: ``<directory>/worker-<i>/round-<r:06d>.pt``. Each file is

    MAGIC (8 bytes) | payload length (8 bytes, little-endian) | sha256 of payload (32 bytes) | payload

where the payload is ``torch.save(state)``. A file is written to a temp file in the same folder, fsynced,
renamed over its final name (atomic on POSIX) and the folder fsynced, so a crash leaves either the old set
of checkpoints or the new one, never a half file under a final name. Loading checks length and digest, so
a truncated or bit-flipped file is skipped with a warning and the previous checkpoint is used instead.
Leftover temp files (names starting with ``.``) are ignored.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAGIC = b"DILOCK01"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 digest
_NAME_RE = re.compile(r"^round-(\d+)\.pt$")


@dataclass
class CheckpointConfig:
    every_rounds: int = 1  # save every N outer rounds; 0 = never
    keep: int = 2  # how many recent checkpoints to keep per worker


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is truncated, bit-flipped or not ours."""


def _worker_dir(directory: Path, worker_index: int) -> Path:
    return Path(directory) / f"worker-{worker_index}"


def list_checkpoints(directory: Path, worker_index: int) -> list[tuple[int, Path]]:
    """(round, path) of this worker's checkpoint files, oldest first; temp files are not listed."""
    folder = _worker_dir(directory, worker_index)
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


def save_checkpoint(
    directory: Path, worker_index: int, round_index: int, state: dict[str, Any], *, keep: int = 2
) -> Path:
    """Write ``state`` atomically as this worker's checkpoint for ``round_index``; keep the newest ``keep``.

    Serializes to memory first (one extra copy of the state in RAM) so the digest is known before
    anything touches the disk.
    """
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    if round_index < 0:
        raise ValueError(f"round_index must be >= 0, got {round_index}")
    folder = _worker_dir(directory, worker_index)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"round-{round_index:06d}.pt"

    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    header = _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest())

    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    logger.debug("saved checkpoint %s (%d bytes)", final, len(payload))

    for _, old in list_checkpoints(directory, worker_index)[:-keep]:
        old.unlink(missing_ok=True)
        logger.debug("pruned checkpoint %s", old)
    return final


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


def load_latest_checkpoint(directory: Path, worker_index: int) -> dict[str, Any] | None:
    """Newest valid checkpoint of this worker, skipping corrupt ones with a warning; None if there is none."""
    for _, path in reversed(list_checkpoints(directory, worker_index)):
        try:
            state = read_checkpoint(path)
        except Exception as exc:  # corrupt, truncated, or unreadable: fall back to the previous one
            logger.warning("skipping unusable checkpoint %s: %s", path, exc)
            continue
        logger.info("loaded checkpoint %s", path)
        return state
    return None


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
