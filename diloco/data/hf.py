"""Hugging Face data: text from a local dataset (``data.dataset``) and token ids from a local
tokenizer (``data.tokenizer``), feeding the same flat token tensor as the byte-level corpus.

``data.dataset`` is a folder written by ``Dataset.save_to_disk`` (read with ``load_from_disk``,
``data.split`` picks the split of a ``DatasetDict``) or local data files, a file, a folder or a
glob, of one kind: ``.txt``/``.md`` (one row per line), ``.json``/``.jsonl``, ``.parquet``,
``.csv``, read with ``datasets.load_dataset``. Rows are documents; their ``data.text_field`` is
read in order, each followed by a newline, until ``data.max_bytes`` of text (0 = all of it).

``data.tokenizer`` is a folder saved by ``save_pretrained`` (any fast tokenizer transformers can
load locally) or a bare ``tokenizer.json`` (read by the ``tokenizers`` package alone: the same ids,
no transformers needed). Documents are tokenized in batches, without special tokens, and
concatenated into one tensor of the narrowest dtype that holds the vocabulary.

Nothing is downloaded. The corpus is held in memory, unless ``data.token_cache`` names a folder:
then the dataset (or ``data.path``) is streamed into a memory-mapped file of token ids (``diloco/data/token_cache.py``).
"""

from __future__ import annotations

import glob
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from diloco.data.source import DataConfig, token_dtype, truncate_documents
from diloco.errors import DataError
from diloco.optional_deps import import_hf

logger = logging.getLogger(__name__)

SAVED_DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")  # written by save_to_disk
BUILDERS = {".txt": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
ROWS_PER_READ = 1000


def _data_files(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if path.is_dir():
        return sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in BUILDERS)
    if path.is_file():
        return [path]
    return sorted(Path(f) for f in glob.glob(str(path), recursive=True) if Path(f).is_file())


def _open_dataset(cfg: DataConfig, *, streaming: bool):
    """The dataset named by ``data.dataset`` and ``data.split``, and a description.

    A ``save_to_disk`` folder is memory-mapped Arrow, read batch by batch either way; data files
    are read as a stream (an ``IterableDataset``, nothing converted up front) with ``streaming``.
    """
    datasets = import_hf("datasets", needed_for="data.dataset", error=DataError)
    datasets.disable_progress_bars()
    path = Path(cfg.dataset).expanduser()
    if path.is_dir() and any((path / marker).is_file() for marker in SAVED_DATASET_MARKERS):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if cfg.split not in loaded:
                raise DataError(f"data.split={cfg.split!r} is not a split of {path} ({', '.join(loaded)})")
            loaded = loaded[cfg.split]
        return loaded, f"dataset {path} ({cfg.split})"
    files = _data_files(cfg.dataset)
    if not files:
        raise DataError(f"data.dataset={cfg.dataset!r} matches no {'/'.join(BUILDERS)} files")
    builders = {BUILDERS.get(f.suffix) for f in files}
    if len(builders) != 1 or None in builders:
        suffixes = sorted({f.suffix for f in files})
        raise DataError(f"data.dataset={cfg.dataset!r}: files of one kind please, found {', '.join(suffixes)}")
    (builder,) = builders
    loaded = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=streaming)
    return loaded, f"{len(files)} {builder} files under {cfg.dataset}"


def _require_text_field(cfg: DataConfig, columns: list[str]) -> None:
    if cfg.text_field not in columns:
        raise DataError(
            f"data.text_field={cfg.text_field!r} is not a column of data.dataset={cfg.dataset!r} "
            f"(columns: {', '.join(columns)})"
        )


def _document_batches(dataset, cfg: DataConfig) -> Iterator[list[bytes]]:
    """The rows' ``data.text_field``, UTF-8 with a newline each, ``ROWS_PER_READ`` rows at a time."""
    if dataset.column_names is not None:  # streamed text files learn their columns from the first rows
        _require_text_field(cfg, dataset.column_names)
        dataset = dataset.select_columns([cfg.text_field])
    for rows in dataset.iter(batch_size=ROWS_PER_READ):
        _require_text_field(cfg, list(rows))
        yield [f"{text}\n".encode() for text in rows[cfg.text_field]]


def open_documents(cfg: DataConfig, *, streaming: bool = False) -> tuple[Iterator[list[bytes]], str]:
    """The documents of ``data.dataset`` in batches (read lazily), and a description of the source."""
    dataset, source = _open_dataset(cfg, streaming=streaming)
    return _document_batches(dataset, cfg), source


def within_budget(batches: Iterator[list[bytes]], max_bytes: int) -> Iterator[list[bytes]]:
    """The batches up to ``max_bytes`` bytes of text in all, the last document cut; all of them with 0.
    Reading stops there: the rest of a large dataset is never read."""
    remaining = max_bytes
    for batch in batches:
        if not max_bytes:
            yield batch
            continue
        kept = truncate_documents(batch, remaining)
        yield kept
        remaining -= sum(len(document) for document in kept)
        if remaining <= 0:
            return


def read_dataset(cfg: DataConfig) -> tuple[list[bytes], str]:
    """The documents of ``data.dataset`` (UTF-8, each ending in a newline), up to ``data.max_bytes``."""
    batches, source = open_documents(cfg)
    documents = [document for batch in within_budget(batches, cfg.max_bytes) for document in batch]
    if not any(documents):
        raise DataError(f"data.dataset={cfg.dataset!r} holds no text in column {cfg.text_field!r}")
    return documents, source


class BareTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` package alone (no transformers), called as a
    transformers fast tokenizer is for encoding: the same ids, no truncation, no padding."""

    def __init__(self, path: Path) -> None:
        tokenizers = import_hf("tokenizers", needed_for="data.tokenizer", error=DataError)
        try:
            self.backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception for a file it cannot parse
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise DataError(
                f"data.tokenizer={str(path)!r} is not a tokenizer.json tokenizers can load: {first_line}"
            ) from None
        self.backend.no_truncation()
        self.backend.no_padding()

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, texts: list[str], *, add_special_tokens: bool = False, verbose: bool = False) -> dict:
        encode_batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)  # fast: no offsets
        encodings = encode_batch(texts, add_special_tokens=add_special_tokens)
        return {"input_ids": [encoding.ids for encoding in encodings]}


def load_tokenizer(path: str):
    """A fast tokenizer from a local folder (transformers) or a ``tokenizer.json`` (``tokenizers``
    alone); ``DataError`` naming the key otherwise."""
    location = Path(path).expanduser()
    if location.is_file():
        return BareTokenizer(location)
    transformers = import_hf("transformers", needed_for="data.tokenizer", error=DataError)
    try:
        return transformers.AutoTokenizer.from_pretrained(str(location), local_files_only=True)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"data.tokenizer={path!r} is not a tokenizer transformers can load: {first_line}") from None


def encode(tokenizer, documents: list[bytes]) -> np.ndarray:
    """The token ids of ``documents``, one after another, as a flat int64 array (no special tokens)."""
    texts = [document.decode("utf-8", errors="replace") for document in documents]
    # verbose=False: the corpus is cut into training windows later, so a long document is no error
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    count = sum(len(row) for row in ids)
    return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=count)


def tokenize(documents: list[bytes], tokenizer_path: str) -> tuple[torch.Tensor, int]:
    """All ``documents`` as one flat tensor of token ids, and the tokenizer's vocabulary size."""
    tokenizer = load_tokenizer(tokenizer_path)
    vocab_size = len(tokenizer)  # added tokens included
    tokens = torch.from_numpy(encode(tokenizer, documents)).to(token_dtype(vocab_size))
    logger.info("tokenized %d documents into %d tokens (vocabulary %d)", len(documents), len(tokens), vocab_size)
    return tokens, vocab_size
