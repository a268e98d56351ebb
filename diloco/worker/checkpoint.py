"""Atomic save / load of everything a worker needs to resume, written off the training loop.

A worker hands its state to a ``CheckpointWriter`` after an outer round and goes on training: a
thread of the writer's streams the state to disk straight from the live tensors, nothing copied
(the file's format, and how training waits for the parts it is about to change: ``checkpoint_file.py``).
It never runs two writes at once: a save that comes while the previous one is still writing waits
for it. At start-up the worker reads its newest whole checkpoint (``read_newest``; which state it
resumes from when its own newest is damaged: resume.py). The state is an opaque dict (model and
optimizer state dicts, ``capture_rng_state()``, sampler position, round, ...).

Layout: ``<directory>/worker-<i>/round-<r:06d>.pt``. Each file is streamed into a temp file in the
same folder while its digest is computed; the header is filled in after, then the file is fsynced,
renamed over its final name (atomic on POSIX) and the folder fsynced. So a crash at any moment
(``kill -9`` in the middle of a write included) leaves either the old set of checkpoints or the new
one, never a half file under a final name. Loading checks length and digest, so a truncated or
bit-flipped file is skipped (and the previous checkpoint, or another worker's newer one, is used
instead: resume.py). Leftover temp files (names starting with ``.``) are ignored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.worker.checkpoint_file import CorruptCheckpointError as CorruptCheckpointError
from diloco.worker.checkpoint_file import LiveState, read_file, write_file

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^round-(\d+)\.pt$")


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


def save_checkpoint(
    directory: Path,
    worker_index: int,
    round_index: int,
    state: dict[str, Any] | LiveState,
    *,
    keep: int = 2,
    on_write: Callable[[int], None] | None = None,
) -> Path:
    """Write ``state`` atomically as this worker's checkpoint for ``round_index``; keep the newest ``keep``.

    The body is streamed to the temp file (no serialized copy of the state in memory); a plain
    dict is taken to stay as it is until this returns. ``on_write(bytes_so_far)`` is called after
    each piece (tests use it to crash mid-write).
    """
    live = state if isinstance(state, LiveState) else LiveState(state)
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
            write_file(f, live, on_write=on_write)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        live.release_all()  # nothing waits for a write that failed
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    logger.debug("saved checkpoint %s", final)

    for _, old in list_checkpoints(directory, worker_index)[:-keep]:
        old.unlink(missing_ok=True)
        logger.debug("pruned checkpoint %s", old)
    return final


class CheckpointWriter:
    """This worker's checkpoints, written in the background: ``save`` hands over the state and
    returns; a thread writes it (``save_checkpoint``) from the live tensors. ``live`` says, for each
    top-level part of the state, until when it stays as it is (``checkpoint_file.GROUPS``): before
    the code that changes a part, ``wait_for`` its group. Parts not named are copied at ``save``.
    One write at a time: ``save`` waits for the previous write first. A write that failed (a full
    disk) raises its error from the next ``save`` or from ``close``, which waits for the last
    write: the newest checkpoint is on disk when ``close`` returns."""

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
        self._live: LiveState | None = None  # the state being written
        self._error: BaseException | None = None
        self.last_write_s = 0.0  # how long the last finished write took, in its thread
        self._taken_at: float | None = None  # when the last save began (monotonic)
        self._cost_s = 0.0  # how long it has held training up: its save, and the waits for its parts

    def save(self, round_index: int, state: dict[str, Any], live: Mapping[str, str] | None = None) -> None:
        started = time.monotonic()
        self.wait()
        written = LiveState(state, live or {})
        thread = threading.Thread(target=self._write, args=(round_index, written), name="diloco-checkpoint")
        thread.start()  # only a write under way is waited for
        self._thread, self._live = thread, written
        self._taken_at, self._cost_s = started, time.monotonic() - started

    def worth_taking(self, max_share: float) -> bool:
        """Whether a checkpoint due now is taken: the last one held training up for at most
        ``max_share`` of the time since it was taken, or for under a second (0: always). So
        checkpoints cost at most that share of a run's time whatever the model's size and the disk."""
        if max_share <= 0 or self._taken_at is None or self._cost_s < 1.0:
            return True
        return self._cost_s <= max_share * (time.monotonic() - self._taken_at)

    def writing(self, group: str) -> bool:
        """Whether the write in progress has yet to write the parts of ``group``."""
        live = self._live
        return live is not None and live.waiting(group)

    def wait_for(self, group: str) -> bool:
        """Until the write in progress (if any) has written the parts of ``group``; whether it waited."""
        live = self._live
        if live is None or not live.waiting(group):
            return False
        started = time.monotonic()
        live.wait(group)
        self._cost_s += time.monotonic() - started
        return True

    def wait(self) -> None:
        """Until the write in progress (if any) is on disk; raises the error of one that failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._live = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    close = wait

    def _write(self, round_index: int, state: LiveState) -> None:
        started = time.perf_counter()
        # what training waits for is written at full speed; making the file durable only when
        # training leaves the cores idle (a thread cannot take its priority back once it gave it up)
        state.on_release = lambda group: _yield_cpu_to_training() if group == len(state.tensors) - 1 else None
        try:
            save_checkpoint(
                self.directory, self.worker_index, round_index, state, keep=self.keep, on_write=self._on_write
            )
        except BaseException as exc:  # handed to the training thread at its next save or at close
            self._error = exc
        finally:
            state.release_all()  # however it ended, nothing waits for it any more
            state.forget()  # the tensors it copied, and its references to the live ones, are let go
        self.last_write_s = time.perf_counter() - started


def _yield_cpu_to_training() -> None:
    """The calling thread at the lowest CPU priority (Linux: a thread's nice value is its own):
    a background write takes the cores only when training leaves them idle."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load one checkpoint file to CPU; raise ``CorruptCheckpointError`` if it fails verification."""
    return read_file(path)


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
