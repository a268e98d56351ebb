"""Data: a corpus of tokens, disjoint per-worker shards, and a fixed held-out set.

By default tokens are raw bytes (0..255), so there is no tokenizer to download or version. With
no ``data.path`` the corpus is this machine's own Python standard library source, which exists
wherever Python does and reads back byte-identical on every run. ``data.dataset`` reads a
Hugging Face dataset instead, and ``data.tokenizer`` turns any of these texts into a local
tokenizer's ids (both in ``diloco/data/hf.py``). Whatever the source, the corpus is one flat
token tensor, so sharding, sampling and the held-out batches below are one code path. With
``data.token_cache`` that tensor is a memory-mapped file built once from a streamed
``data.dataset`` or ``data.path`` (``diloco/data/token_cache.py``), for corpora larger than
memory: sampling only gathers windows from it, so pages are read from disk as windows need them.
``data.token_cache`` alone uses the complete cache built there, whatever it was built from.

Usage::

    corpus = load_corpus(DataConfig(max_bytes=1_000_000))
    sampler = ShardSampler(corpus.train, block_size=64, batch_size=16,
                           shard_index=rank, num_shards=world, seed=0)
    x, y = sampler.next_batch()                      # int64 [16, 64]; y is x shifted by one
    val = val_batches(corpus.val, block_size=64, batch_size=16, num_batches=8)
    val_loss = evaluate(model, val)                  # diloco/core/evaluation.py
"""

from __future__ import annotations

import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diloco.data.source import (
    BYTE_VOCAB_SIZE,
    DataConfig,
    describe_path,
    read_text,
    text_files,
    truncate_documents,
)
from diloco.errors import DataError

logger = logging.getLogger(__name__)

DEFAULT_CORPUS_CAP = 4_000_000  # bytes of stdlib source in the embedded corpus (~4 MB)


@dataclass
class Corpus:
    train: torch.Tensor  # token ids (token_dtype(vocab_size)), the first (1 - val_fraction) of them
    val: torch.Tensor  # the remaining token ids
    source: str  # human description of where the text came from
    vocab_size: int = BYTE_VOCAB_SIZE  # token ids are in [0, vocab_size): 256 bytes, or the tokenizer's


def embedded_corpus(cap: int = DEFAULT_CORPUS_CAP) -> bytes:
    """The first ``cap`` bytes of the stdlib's top-level ``*.py`` files, concatenated in sorted order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for f in sorted(stdlib.glob("*.py")):
        if total >= cap:
            break
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
    return b"".join(chunks)[:cap]


def _read_path(path: str, cap: int) -> tuple[list[bytes], str]:
    """The text files under ``data.path``, one document each, in sorted order."""
    p = Path(path).expanduser()
    files = text_files(path)
    if p.is_file():
        data = read_text(p, path, cap)
        if not data:
            raise DataError(f"data.path {path!r} is an empty file")
        return [data], describe_path(path, files)
    documents = [read_text(f, path) for f in files]
    if not any(documents):
        raise DataError(f"data.path {path!r}: all {len(files)} text files are empty")
    return documents, describe_path(path, files)


def _read_tokens(cfg: DataConfig) -> tuple[torch.Tensor, int, str]:
    """All of the corpus's token ids in memory, its vocabulary size, and where the text came from."""
    if cfg.dataset:
        from diloco.data.hf import read_dataset

        documents, source = read_dataset(cfg)
    elif cfg.path:
        documents, source = _read_path(cfg.path, cfg.max_bytes)
    else:
        cap = min(DEFAULT_CORPUS_CAP, cfg.max_bytes) if cfg.max_bytes else DEFAULT_CORPUS_CAP
        documents, source = [embedded_corpus(cap)], "embedded corpus (Python stdlib source)"
    documents = truncate_documents(documents, cfg.max_bytes)
    if not cfg.tokenizer:
        return torch.frombuffer(bytearray(b"".join(documents)), dtype=torch.uint8), BYTE_VOCAB_SIZE, source
    from diloco.data.hf import tokenize

    tokens, vocab_size = tokenize(documents, cfg.tokenizer)
    return tokens, vocab_size, f"{source}, tokenized by {cfg.tokenizer}"


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read the corpus named by ``cfg``, turn it into token ids, and split it into train (head) and val (tail)."""
    where = f"data.dataset={cfg.dataset!r}" if cfg.dataset else f"data.path={cfg.path!r}"
    if cfg.token_cache and not (cfg.dataset or cfg.path):
        where = f"data.token_cache={cfg.token_cache!r}"
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be in [0, 1), got {cfg.val_fraction} ({where})")
    if cfg.max_bytes < 0:
        raise DataError(f"data.max_bytes must be >= 0, got {cfg.max_bytes} ({where})")
    if cfg.token_cache:
        from diloco.data.token_cache import load_token_cache

        tokens, vocab_size, source = load_token_cache(cfg)
    else:
        tokens, vocab_size, source = _read_tokens(cfg)
    n_train = len(tokens) - int(len(tokens) * cfg.val_fraction)
    if n_train < 2 or (cfg.val_fraction > 0 and n_train == len(tokens)):
        raise DataError(
            f"{where}: corpus of {len(tokens)} tokens is too small to split with data.val_fraction={cfg.val_fraction}"
        )
    train, val = tokens[:n_train], tokens[n_train:]
    if not cfg.token_cache:  # each split its own storage in memory; a token cache stays one file mapping
        train, val = train.clone(), val.clone()
    corpus = Corpus(train=train, val=val, source=source, vocab_size=vocab_size)
    logger.info("corpus: %s, %d train tokens, %d val tokens", source, len(corpus.train), len(corpus.val))
    return corpus


def shard_bounds(n_tokens: int, shard_index: int, num_shards: int) -> tuple[int, int]:
    """``[start, end)`` of contiguous region ``shard_index`` when ``n_tokens`` are cut ``num_shards`` ways."""
    if num_shards <= 0 or not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
    return n_tokens * shard_index // num_shards, n_tokens * (shard_index + 1) // num_shards


def shard_regions(n_tokens: int, shard_index: int, num_shards: int, chunk: int = 0) -> tuple[torch.Tensor, int]:
    """The starts of shard ``shard_index``'s regions, all of one length: ``(starts, length)``.

    With ``chunk == 0`` a shard is one contiguous region (``shard_bounds``). Otherwise the tokens are
    cut into chunks of ``chunk`` tokens, dealt round-robin (chunk ``i`` to shard ``i % num_shards``),
    so each shard samples the whole corpus rather than one stretch of it (a quarter of a book is not
    like the book); the tail shorter than a chunk is left out. A corpus with fewer than
    ``num_shards`` whole chunks falls back to contiguous regions.
    """
    start, end = shard_bounds(n_tokens, shard_index, num_shards)
    if chunk > 0 and n_tokens // chunk < num_shards:
        logger.warning(
            "data.shard_chunk=%d: fewer whole chunks than the %d workers; each takes one contiguous stretch",
            chunk,
            num_shards,
        )
        chunk = 0
    if chunk <= 0:
        return torch.tensor([start]), end - start
    return torch.arange(shard_index, n_tokens // chunk, num_shards) * chunk, chunk


def _windows(tokens: torch.Tensor, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # One gather instead of a Python loop over rows: [batch, block_size + 1] offsets.
    rows = tokens[starts[:, None] + torch.arange(block_size + 1)].long()
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class ShardSampler:
    """Random training windows from one worker's disjoint share of the train tokens.

    Every window of ``block_size + 1`` tokens lies inside one region of shard ``shard_index``
    (``shard_regions``: one contiguous stretch, or chunks dealt round-robin), so two workers never
    train on the same tokens. The draw order depends only on ``(seed, shard_index)`` and the number
    of batches drawn, and ``state_dict`` captures it so a resumed worker continues with exactly the
    batches it would have seen.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        block_size: int,
        batch_size: int,
        shard_index: int,
        num_shards: int,
        seed: int,
        chunk: int = 0,
    ) -> None:
        if block_size <= 0 or batch_size <= 0:
            raise ValueError(f"block_size and batch_size must be positive, got {block_size}, {batch_size}")
        self.starts, self.length = shard_regions(len(tokens), shard_index, num_shards, chunk)
        if self.length < block_size + 1:
            raise DataError(
                f"corpus too small: shard {shard_index} of {num_shards} has regions of "
                f"{self.length} train tokens, fewer than block_size + 1 = {block_size + 1}; "
                f"use a larger corpus (data.path, data.dataset) or data.max_bytes, fewer workers, "
                f"a shorter block{', or a larger data.shard_chunk' if chunk else ''}"
            )
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.seed = seed
        self.chunk = chunk
        self.batches_drawn = 0
        self.generator = torch.Generator()
        # Mix the shard into the seed so workers draw different (as well as disjoint) windows.
        self.generator.manual_seed((seed * 1_000_003 + shard_index) % 2**63)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: int64 [batch_size, block_size], ``y`` is ``x`` shifted left by one."""
        return _windows(self.tokens, self._next_starts(), self.block_size)

    def skip(self, batches: int) -> None:
        """Move on as if ``batches`` more batches had been drawn: the same draws, no windows gathered."""
        for _ in range(batches):
            self._next_starts()

    def _next_starts(self) -> torch.Tensor:
        """Where the next batch's windows start; counts the batch as drawn."""
        # Offsets so that offset + block_size + 1 <= length (randint's high is exclusive).
        offsets = torch.randint(0, self.length - self.block_size, (self.batch_size,), generator=self.generator)
        if len(self.starts) == 1:  # one region: no region draw, so the windows are those drawn before chunks existed
            starts = self.starts + offsets
        else:  # regions of equal length: a uniform region, then a uniform offset, is a uniform window
            region = torch.randint(0, len(self.starts), (self.batch_size,), generator=self.generator)
            starts = self.starts[region] + offsets
        self.batches_drawn += 1
        return starts

    def state_dict(self) -> dict[str, Any]:
        return {
            "generator": self.generator.get_state(),
            "batches_drawn": self.batches_drawn,
            "shard_index": self.shard_index,
            "num_shards": self.num_shards,
            "seed": self.seed,
            "chunk": self.chunk,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {"chunk": 0, **state}  # a state saved before data.shard_chunk existed: contiguous shards
        for key in ("shard_index", "num_shards", "seed", "chunk"):
            if saved[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={saved[key]}, this sampler has "
                    f"{key}={getattr(self, key)}; resume with the same worker layout, seed and data.shard_chunk"
                )
        self.generator.set_state(state["generator"])
        self.batches_drawn = int(state["batches_drawn"])


def val_batches(
    tokens: torch.Tensor, *, block_size: int, batch_size: int, num_batches: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of validation batches, identical on every worker given the same tokens and seed."""
    if len(tokens) < block_size + 1:
        raise DataError(
            f"corpus too small: {len(tokens)} validation tokens, fewer than "
            f"block_size + 1 = {block_size + 1}; raise data.val_fraction or data.max_bytes"
        )
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - block_size, (num_batches, batch_size), generator=g)
    return [_windows(tokens, row, block_size) for row in starts]
