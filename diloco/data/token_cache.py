"""A token cache for corpora larger than memory (``data.token_cache``, a folder).

The first run streams ``data.dataset`` (data files through ``load_dataset(..., streaming=True)``,
a ``save_to_disk`` folder batch by batch) or ``data.path`` (its text files, file by file, one
document each, without the ``datasets`` package), tokenizes it in batches and appends the ids to a
flat binary file of the narrowest dtype (``token_dtype``). Every later load, and every worker of a run
on this machine, memory-maps that file (``numpy.memmap`` under ``torch.from_numpy``: no copy, pages
come from disk as sampling touches them) as long as its header says it was built, completely,
from the same source and tokenizer. The folder holds:

- ``tokens.bin``: the token ids, one after another (written as ``tokens.bin.partial``, then renamed);
- ``tokens.json``: the header. What the ids were built from (dataset path, split, column, or the
  text path; ``data.max_bytes``, tokenizer path, and a fingerprint of the names, sizes and mtimes of their
  files), the vocabulary size, dtype and token count, and ``"complete": true``, written last. A
  build that dies half-way leaves ``"complete": false`` and is rebuilt, never used;
- ``tokens.lock``: held (``flock``) by the one process that checks or builds the cache, so workers
  starting together on one machine build it once: the others wait, then find it complete.

``data.token_cache`` with neither ``data.path`` nor ``data.dataset`` uses the complete cache in
that folder as it was built, whatever its source (a machine that received a prebuilt cache, e.g.
from ``diloco corpus``, without the raw text); nothing there is a one-line ``DataError``.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.data.source import BYTE_VOCAB_SIZE, DataConfig, describe_path, read_text, text_files, token_dtype
from diloco.errors import DataError, make_folder

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the file layout or the tokenization rule changes: old caches rebuild
TOKENS_FILE, HEADER_FILE, LOCK_FILE = "tokens.bin", "tokens.json", "tokens.lock"
LOCK_WAIT_S = 6 * 3600.0  # the longest a worker waits for another process building the cache
PROGRESS_EVERY_TOKENS = 10_000_000  # a log line each time the build passes another 10 M tokens
BATCH_BYTES, BATCH_FILES = 32 << 20, 1024  # data.path: files read into one batch until either is reached

Encoder = Callable[[list[bytes]], np.ndarray]  # documents -> their token ids, flat


def load_token_cache(cfg: DataConfig) -> tuple[torch.Tensor, int, str]:
    """The token ids of ``data.dataset`` or ``data.path`` memory-mapped from ``data.token_cache``
    (built first if missing, incomplete or built from something else), its vocabulary size, and its
    source; with neither, the complete cache there as it was built."""
    folder = Path(cfg.token_cache).expanduser()
    if not (cfg.dataset or cfg.path):
        header = _prebuilt(cfg, folder)
    else:
        make_folder(folder, "data.token_cache", DataError)
        identity = _identity(cfg)
        with _exclusive(folder / LOCK_FILE):
            header = _read_header(folder)
            if _is_usable(header, identity, folder):
                logger.info("token cache %s: reusing %d tokens", folder, header["tokens"])
            else:
                header = _build(cfg, folder, identity)
    tokens = np.memmap(folder / TOKENS_FILE, dtype=header["dtype"], mode="c", shape=(header["tokens"],))
    return torch.from_numpy(tokens), header["vocab_size"], header["source"]


def _prebuilt(cfg: DataConfig, folder: Path) -> dict[str, Any]:
    """The header of the complete cache in ``folder``, whatever its source; ``DataError`` if none."""
    how = "build one with `diloco corpus OUT_DIR` (then data.token_cache=OUT_DIR/cache) or set data.path/data.dataset"
    if not folder.is_dir():
        raise DataError(
            f"data.token_cache={cfg.token_cache!r} does not exist and there is no source to build it: {how}"
        )
    try:
        with _exclusive(folder / LOCK_FILE):  # a build under way on this machine: wait for it
            header = _read_header(folder)
    except OSError:  # a read-only copy of a cache: nobody builds there
        header = _read_header(folder)
    if not _is_complete(header, folder):
        raise DataError(f"data.token_cache={cfg.token_cache!r} holds no complete token cache: {how}")
    if cfg.max_bytes or cfg.tokenizer:
        logger.info("token cache %s: used as built; data.max_bytes and data.tokenizer do not apply", folder)
    logger.info("token cache %s: reusing %d tokens (%s)", folder, header["tokens"], header.get("source", "?"))
    return header


def _files_fingerprint(spec: str) -> str:
    """A hash of the names, sizes and mtimes of the files at ``spec`` (a file, a folder or a glob)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file())
    else:
        files = [path] if path.is_file() else sorted(Path(f) for f in glob.glob(str(path), recursive=True))
    digest = hashlib.sha256()
    for f in files:
        stat = f.stat()
        digest.update(f"{f.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _identity(cfg: DataConfig) -> dict[str, Any]:
    """What the cached ids depend on; a header that differs in any of these is rebuilt."""
    if cfg.path:
        return {
            "format": CACHE_FORMAT,
            "path": str(Path(cfg.path).expanduser().absolute()),
            "path_files": _files_fingerprint(cfg.path),
            "max_bytes": cfg.max_bytes,
            "tokenizer": str(Path(cfg.tokenizer).expanduser().absolute()) if cfg.tokenizer else "",
            "tokenizer_files": _files_fingerprint(cfg.tokenizer) if cfg.tokenizer else "",
        }
    return {
        "format": CACHE_FORMAT,
        "dataset": str(Path(cfg.dataset).expanduser().absolute()),
        "dataset_files": _files_fingerprint(cfg.dataset),
        "split": cfg.split,
        "text_field": cfg.text_field,
        "max_bytes": cfg.max_bytes,
        "tokenizer": str(Path(cfg.tokenizer).expanduser().absolute()) if cfg.tokenizer else "",
        "tokenizer_files": _files_fingerprint(cfg.tokenizer) if cfg.tokenizer else "",
    }


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (released by the kernel if this process dies)."""
    with open(lock_path, "a") as handle:
        _lock_within(handle, lock_path.parent, LOCK_WAIT_S)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _lock_within(handle, folder: Path, limit_s: float) -> None:
    """Take the exclusive lock of ``handle``, waiting for a process that builds the cache (the kernel
    lets go of a dead one's) at most ``limit_s`` seconds, with a line every minute; ``DataError`` then."""
    started = time.monotonic()
    next_line = started
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now = time.monotonic()
            if now - started > limit_s:
                raise DataError(
                    f"token cache {folder}: another process has been building it for over {limit_s / 3600:g} h; "
                    "wait for it, or stop it and build the cache again"
                ) from None
            if now >= next_line:
                logger.info(
                    "token cache %s: another process is building it; waiting (%.0f s so far)", folder, now - started
                )
                next_line = now + 60
            time.sleep(0.5)  # polling a lock another process holds (flock has no timeout)


def _read_header(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / HEADER_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_header(folder: Path, header: dict[str, Any]) -> None:
    """Replace the header in one step, so a reader sees the old one or the new one, never half."""
    partial = folder / f"{HEADER_FILE}.partial"
    partial.write_text(json.dumps(header, indent=2) + "\n")
    os.replace(partial, folder / HEADER_FILE)


def _is_usable(header: dict[str, Any], identity: dict[str, Any], folder: Path) -> bool:
    """A complete build from the same source and tokenizer, its file as long as the header says."""
    return all(header.get(key) == value for key, value in identity.items()) and _is_complete(header, folder)


def _is_complete(header: dict[str, Any], folder: Path) -> bool:
    """Marked complete, its file as long as the header says."""
    if not header.get("complete"):
        return False
    expected_bytes = header["tokens"] * np.dtype(header["dtype"]).itemsize
    tokens_file = folder / TOKENS_FILE
    return tokens_file.is_file() and tokens_file.stat().st_size == expected_bytes


def _encoder(tokenizer_path: str) -> tuple[Encoder, int, str]:
    """How to turn documents into ids, the vocabulary size, and the words for the source line."""
    if not tokenizer_path:
        return (lambda documents: np.frombuffer(b"".join(documents), dtype=np.uint8)), BYTE_VOCAB_SIZE, ""
    from diloco.data.hf import encode, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    return (lambda documents: encode(tokenizer, documents)), len(tokenizer), f", tokenized by {tokenizer_path}"


def _build(cfg: DataConfig, folder: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """Stream, tokenize and append the whole dataset to ``tokens.bin``; the completed header."""
    from diloco.data.hf import within_budget

    batches, source = _open_source(cfg)
    encode, vocab_size, tokenized_by = _encoder(cfg.tokenizer)
    dtype = np.dtype(str(token_dtype(vocab_size)).removeprefix("torch."))
    header = {**identity, "source": source + tokenized_by, "vocab_size": vocab_size, "dtype": dtype.name}
    _write_header(folder, {**header, "tokens": 0, "complete": False})
    logger.info("token cache %s: building from %s", folder, header["source"])
    count = _append_tokens(folder / TOKENS_FILE, within_budget(batches, cfg.max_bytes), encode, dtype)
    if count == 0 and cfg.dataset:
        raise DataError(f"data.dataset={cfg.dataset!r} holds no text in column {cfg.text_field!r}")
    if count == 0:
        raise DataError(f"data.path={cfg.path!r}: its text files are empty")
    header.update(tokens=count, complete=True)
    _write_header(folder, header)
    logger.info("token cache %s: built, %d tokens (%s)", folder, count, dtype.name)
    return header


def _open_source(cfg: DataConfig) -> tuple[Iterator[list[bytes]], str]:
    """The documents of ``data.dataset`` or ``data.path`` in batches, read lazily, and a description."""
    if cfg.dataset:
        from diloco.data.hf import open_documents

        return open_documents(cfg, streaming=True)
    files = text_files(cfg.path)
    return _file_batches(files, cfg.path), describe_path(cfg.path, files)


def _file_batches(files: list[Path], path: str) -> Iterator[list[bytes]]:
    """Each of ``data.path``'s files one document, read in order and batched by ``BATCH_BYTES`` / ``BATCH_FILES``."""
    batch: list[bytes] = []
    size = read = 0
    for index, file in enumerate(files):
        batch.append(read_text(file, path))
        size += len(batch[-1])
        if size >= BATCH_BYTES or len(batch) >= BATCH_FILES or index == len(files) - 1:
            read += size
            logger.info("token cache: read %d of %d files (%.1f MB)", index + 1, len(files), read / 1e6)
            yield batch
            batch, size = [], 0


def _append_tokens(path: Path, batches: Iterator[list[bytes]], encode: Encoder, dtype: np.dtype) -> int:
    """Write each batch's ids as ``dtype`` to a new file that then replaces ``path`` (a process still
    mapping the old file keeps reading it intact); the number of ids written."""
    count = 0
    partial = path.with_name(f"{path.name}.partial")
    with open(partial, "wb") as out:
        for documents in batches:
            ids = encode(documents).astype(dtype)
            out.write(ids.tobytes())
            if (count + len(ids)) // PROGRESS_EVERY_TOKENS > count // PROGRESS_EVERY_TOKENS:
                logger.info("token cache %s: %d M tokens so far", path.parent, (count + len(ids)) // 1_000_000)
            count += len(ids)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
    return count
