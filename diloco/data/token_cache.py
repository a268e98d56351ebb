"""A token cache for corpora larger than memory (``data.token_cache``, a folder).

The first run streams ``data.dataset`` (data files through ``load_dataset(..., streaming=True)``,
a ``save_to_disk`` folder batch by batch), tokenizes it in batches and appends the ids to a flat
binary file of the narrowest dtype (``token_dtype``). Every later load, and every worker of a run
on this machine, memory-maps that file (``numpy.memmap`` under ``torch.from_numpy``: no copy, pages
come from disk as sampling touches them) as long as its header says it was built, completely,
from the same source and tokenizer. The folder holds:

- ``tokens.bin``: the token ids, one after another (written as ``tokens.bin.partial``, then renamed);
- ``tokens.json``: the header. What the ids were built from (dataset path, split, column,
  ``data.max_bytes``, tokenizer path, and a fingerprint of the names, sizes and mtimes of their
  files), the vocabulary size, dtype and token count, and ``"complete": true``, written last. A
  build that dies half-way leaves ``"complete": false`` and is rebuilt, never used;
- ``tokens.lock``: held (``flock``) by the one process that checks or builds the cache, so workers
  starting together on one machine build it once: the others wait, then find it complete.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.data.corpus import BYTE_VOCAB_SIZE, DataConfig, DataError, token_dtype

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the file layout or the tokenization rule changes: old caches rebuild
TOKENS_FILE, HEADER_FILE, LOCK_FILE = "tokens.bin", "tokens.json", "tokens.lock"
PROGRESS_EVERY_TOKENS = 10_000_000  # a log line each time the build passes another 10 M tokens

Encoder = Callable[[list[bytes]], np.ndarray]  # documents -> their token ids, flat


def load_token_cache(cfg: DataConfig) -> tuple[torch.Tensor, int, str]:
    """The token ids of ``data.dataset`` memory-mapped from ``data.token_cache`` (built first if
    missing, incomplete or built from something else), its vocabulary size, and its source."""
    folder = Path(cfg.token_cache).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    identity = _identity(cfg)
    with _exclusive(folder / LOCK_FILE):
        header = _read_header(folder)
        if _is_usable(header, identity, folder):
            logger.info("token cache %s: reusing %d tokens", folder, header["tokens"])
        else:
            header = _build(cfg, folder, identity)
    tokens = np.memmap(folder / TOKENS_FILE, dtype=header["dtype"], mode="c", shape=(header["tokens"],))
    return torch.from_numpy(tokens), header["vocab_size"], header["source"]


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
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("token cache %s: another process holds it, waiting", lock_path.parent)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
    if not header.get("complete") or any(header.get(key) != value for key, value in identity.items()):
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
    from diloco.data.hf import open_documents, within_budget

    batches, source = open_documents(cfg, streaming=True)
    encode, vocab_size, tokenized_by = _encoder(cfg.tokenizer)
    dtype = np.dtype(str(token_dtype(vocab_size)).removeprefix("torch."))
    header = {**identity, "source": source + tokenized_by, "vocab_size": vocab_size, "dtype": dtype.name}
    _write_header(folder, {**header, "tokens": 0, "complete": False})
    logger.info("token cache %s: building from %s", folder, header["source"])
    count = _append_tokens(folder / TOKENS_FILE, within_budget(batches, cfg.max_bytes), encode, dtype)
    if count == 0:
        raise DataError(f"data.dataset={cfg.dataset!r} holds no text in column {cfg.text_field!r}")
    header.update(tokens=count, complete=True)
    _write_header(folder, header)
    logger.info("token cache %s: built, %d tokens (%s)", folder, count, dtype.name)
    return header


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
