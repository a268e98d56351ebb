"""A real corpus available offline: the Python source of the installed packages, and a BPE tokenizer
trained on it here.

``collect_python_sources(out_dir)`` writes the ``.py`` files of the running interpreter's
site-packages (``sysconfig`` ``purelib``/``platlib``; diloco itself left out) into one
deterministic set of text shards, ``out_dir/text/shard-00000.txt``, ... (about ``SHARD_BYTES``
each), files in the order of their relative paths' sha256 (a fixed shuffle: the held-out tail and
each worker's shard hold files of every package, not the last ones in alphabetical order), each
preceded by a line ``# file: <relative path>``;
files that are not valid UTF-8, and empty ones, are skipped. ``out_dir/manifest.json`` records the
file count, bytes, each shard's sha256 and the versions of the distributions found. Run again with
the same installed files, it reuses the shards as they are (their mtimes too, so a token cache
built from them stays valid).

``train_bpe_tokenizer(text_dir, out_path)`` trains a byte-level BPE (``tokenizers``: byte-level
pre-tokenizer and decoder, special token ``<|endoftext|>``) on those shards, one source file per
training sequence, and saves it as a ``tokenizer.json``; the same text gives the same file.

The shards are ``data.path`` text files like any other: ``diloco corpus OUT_DIR`` tokenizes them
into a token cache (``diloco/data/token_cache.py``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from diloco.errors import DataError
from diloco.optional_deps import import_hf

logger = logging.getLogger(__name__)

MANIFEST_FILE, TEXT_DIR = "manifest.json", "text"
SHARD_BYTES = 16 << 20  # one shard is one document when tokenized: several per batch keep every core busy
FORMAT = 2  # bump when the shard layout changes: old shards are rewritten (2: files in a fixed shuffle)
SPECIAL_TOKEN = "<|endoftext|>"
FILE_MARKER = "# file: "
SKIPPED_PREFIXES = ("diloco-", "diloco.", "__editable___diloco")  # this project (beside diloco/), however installed


def python_roots() -> list[Path]:
    """The running interpreter's site-packages folders (``purelib``, ``platlib``), existing, deduplicated."""
    roots: list[Path] = []
    for key in ("purelib", "platlib"):
        root = Path(sysconfig.get_paths()[key]).resolve()
        if root.is_dir() and root not in roots:
            roots.append(root)
    return roots


def _skipped(relative: Path, path: Path, bin_dir: Path) -> bool:
    top = relative.parts[0]
    return top == "diloco" or top.startswith(SKIPPED_PREFIXES) or path.is_relative_to(bin_dir)


def _python_files(roots: list[Path]) -> list[tuple[str, Path]]:
    """``(relative path, path)`` of every ``.py`` file under ``roots``, in the order of the relative
    paths' sha256 (the same on every machine); the first root wins a relative path found in two."""
    bin_dir = Path(sys.prefix).resolve() / "bin"
    found: dict[str, Path] = {}
    for root in roots:
        for folder, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in filenames:
                path = Path(folder) / name
                relative = path.relative_to(root)
                if name.endswith(".py") and path.is_file() and not _skipped(relative, path, bin_dir):
                    found.setdefault(relative.as_posix(), path)
    return sorted(found.items(), key=lambda item: hashlib.sha256(item[0].encode()).hexdigest())


def _inputs_digest(files: list[tuple[str, Path]], settings: dict[str, Any]) -> str:
    """A hash of the files' names, sizes and mtimes and of the settings: unchanged means the same shards."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for relative, path in files:
        stat = path.stat()
        digest.update(f"{relative}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _entries(files: list[tuple[str, Path]], max_bytes: int, skipped: list[str]) -> Iterator[bytes]:
    """Each UTF-8 file as ``# file: <path>`` and its text (ending in a newline), until ``max_bytes``."""
    total = 0
    for relative, path in files:
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(relative)
            continue
        if not data.strip():
            continue
        entry = f"{FILE_MARKER}{relative}\n".encode() + data + (b"" if data.endswith(b"\n") else b"\n")
        if max_bytes and total + len(entry) > max_bytes:
            return
        total += len(entry)
        yield entry


def _write_shards(entries: Iterator[bytes], folder: Path, shard_bytes: int) -> tuple[list[dict[str, Any]], int]:
    """The entries in shards of about ``shard_bytes`` under ``folder``: each shard's record, and the file count."""
    folder.mkdir(parents=True)
    shards: list[dict[str, Any]] = []
    pending: list[bytes] = []
    size = count = 0

    def flush() -> None:
        name = f"shard-{len(shards):05d}.txt"
        data = b"".join(pending)
        (folder / name).write_bytes(data)
        shards.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        logger.info("corpus: wrote %s (%.1f MB, %d files so far)", name, len(data) / 1e6, count)

    for entry in entries:
        if pending and size + len(entry) > shard_bytes:
            flush()
            pending, size = [], 0
        pending.append(entry)
        size += len(entry)
        count += 1
    if pending:
        flush()
    return shards, count


def _packages(roots: list[Path]) -> dict[str, str]:
    """``{distribution: version}`` of the distributions installed in ``roots`` (diloco left out)."""
    versions = {}
    for dist in importlib.metadata.distributions(path=[str(root) for root in roots]):
        name = (dist.metadata["Name"] or "").lower()
        if name and name != "diloco":
            versions.setdefault(name, dist.version)
    return dict(sorted(versions.items()))


def _reusable(out: Path, inputs: str) -> dict[str, Any] | None:
    """The manifest of shards already written from the same inputs, all still there; else None."""
    try:
        manifest = json.loads((out / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("inputs") != inputs:
        return None
    shards = [(out / TEXT_DIR / shard["name"], shard["bytes"]) for shard in manifest.get("shards", [])]
    intact = all(path.is_file() and path.stat().st_size == size for path, size in shards)
    return manifest if shards and intact else None


def collect_python_sources(
    out_dir: str | Path, roots: list[str | Path] | None = None, *, max_bytes: int = 0, shard_bytes: int = SHARD_BYTES
) -> dict[str, Any]:
    """Write the ``.py`` files under ``roots`` (default: ``python_roots()``) as text shards in
    ``out_dir/text`` and their manifest in ``out_dir/manifest.json``; the manifest. ``max_bytes``
    (0 = all) keeps the whole files that fit in that many bytes of text."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file; the corpus goes in a folder (created if missing)")
    folders = [Path(root).expanduser().resolve() for root in roots] if roots else python_roots()
    missing = [str(root) for root in folders if not root.is_dir()]
    if missing or not folders:
        raise DataError(f"no Python package folder to collect from: {', '.join(missing) or 'none found'}")
    files = _python_files(folders)
    settings = {
        "format": FORMAT,
        "max_bytes": max_bytes,
        "shard_bytes": shard_bytes,
        "roots": [str(f) for f in folders],
    }
    inputs = _inputs_digest(files, settings)
    manifest = _reusable(out, inputs)
    if manifest is not None:
        logger.info(
            "corpus: reusing %d shards in %s (%d .py files found, none changed)",
            len(manifest["shards"]),
            out,
            len(files),
        )
        return manifest
    logger.info("corpus: collecting %d .py files from %s", len(files), ", ".join(str(f) for f in folders))
    partial = out / f"{TEXT_DIR}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    skipped: list[str] = []
    shards, count = _write_shards(_entries(files, max_bytes, skipped), partial, shard_bytes)
    if not shards:
        raise DataError(f"no UTF-8 .py files with text under {', '.join(str(f) for f in folders)}")
    shutil.rmtree(out / TEXT_DIR, ignore_errors=True)
    os.replace(partial, out / TEXT_DIR)
    manifest = {
        **settings,
        "inputs": inputs,
        "files": count,
        "bytes": sum(shard["bytes"] for shard in shards),
        "skipped_not_utf8": skipped,
        "sha256": hashlib.sha256("".join(shard["sha256"] for shard in shards).encode()).hexdigest(),
        "shards": shards,
        "packages": _packages(folders),
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info(
        "corpus: %d files, %.1f MB in %d shards (%d not UTF-8, skipped)",
        count,
        manifest["bytes"] / 1e6,
        len(shards),
        len(skipped),
    )
    return manifest


def _training_texts(shards: list[Path]) -> Iterator[list[str]]:
    """Each shard's source files (split at their ``# file:`` lines), one training sequence each: the
    newline and the next line's indent stay one pre-token, as when the shard is encoded."""
    read = 0
    for index, shard in enumerate(shards):
        text = shard.read_text(encoding="utf-8")
        read += len(text)
        yield [piece for piece in re.split(rf"(?m)^(?={re.escape(FILE_MARKER)})", text) if piece]
        logger.info("tokenizer: counted %d of %d shards (%.1f M chars)", index + 1, len(shards), read / 1e6)


def train_bpe_tokenizer(text_dir: str | Path, out_path: str | Path, vocab_size: int = 32768) -> Path:
    """Train a byte-level BPE of ``vocab_size`` ids (``<|endoftext|>`` included) on the ``.txt``
    files of ``text_dir`` in sorted order; save it as ``out_path`` (a ``tokenizer.json``)."""
    tokenizers = import_hf("tokenizers", needed_for="training a tokenizer", error=DataError)
    shards = sorted(Path(text_dir).expanduser().glob("*.txt"))
    if not shards:
        raise DataError(f"{text_dir} holds no .txt files to train a tokenizer on")
    if vocab_size <= 257:
        raise DataError(f"vocabulary of {vocab_size} ids: a byte-level BPE needs more than 257 (256 bytes, 1 special)")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    started = time.monotonic()
    logger.info("tokenizer: training a %d-id byte-level BPE on %d shards in %s", vocab_size, len(shards), text_dir)
    tokenizer.train_from_iterator(_training_texts(shards), trainer)
    out = Path(out_path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.partial")
    tokenizer.save(str(partial))
    os.replace(partial, out)
    logger.info(
        "tokenizer: %d ids, trained in %.0f s, saved to %s", tokenizer.get_vocab_size(), time.monotonic() - started, out
    )
    return out
