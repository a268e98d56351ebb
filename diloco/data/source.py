"""What a corpus is read from: the ``data.*`` settings, the text files ``data.path`` names (one
that does not look like text refused: ``read_text``), the token ids' dtype. A leaf of
``diloco/data``: the corpus (``corpus.py``), the Hugging Face readers (``hf.py``) and the token
cache (``token_cache.py``) all build on it, and it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.errors import DataError, require

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
BYTE_VOCAB_SIZE = 256  # token ids without a tokenizer: one per byte value
# Text, in any encoding but UTF-16/32, holds no control bytes but whitespace, backspace and escape;
# binary files do: NUL, and a tenth of random bytes. Of 16,688 text files (.py, .txt, .md, .rst,
# .json, .csv) none had any in its first 64 KiB; of 12,510 binary ones (.so, .pyc, .gz, .png, .npy,
# .jpg, .ttf, .pt, .pdf) 7 had 1% or less (.pyc files mostly of docstrings, one .so).
# Invalid UTF-8 is no sign: a Latin-1 or cp1251 file is text a byte-level model learns as well.
SNIFF_BYTES = 64 * 1024
MAX_CONTROL_FRACTION = 0.01
CONTROL_BYTES = bytes(sorted(set(range(32)) - set(b"\t\n\v\f\r\b\x1b"))) + b"\x7f"


@dataclass
class DataConfig:
    path: str = ""  # text file or folder of text files; "" = embedded default corpus
    dataset: str = ""  # a Hugging Face dataset: a save_to_disk folder, or .txt/.jsonl/.parquet/.csv files (glob)
    text_field: str = "text"  # the column of data.dataset that holds the text
    split: str = "train"  # the split of a save_to_disk DatasetDict to read (validation is its tail)
    tokenizer: str = ""  # a local tokenizer (folder saved by save_pretrained, or a tokenizer.json); "" = byte-level
    val_fraction: float = 0.1  # last fraction of the corpus held out for validation
    max_bytes: int = 0  # 0 = no limit; else truncate corpus to this many bytes of text (keeps tests fast)
    shard_chunk: int = 0  # tokens: deal chunks of this size round-robin to the workers; 0 = one contiguous region each
    token_cache: str = ""  # folder: data.path/dataset ids built once, mmapped; alone: as built; "" = in memory


def validate_data_config(data: DataConfig) -> None:
    """Raise ``ConfigError`` naming the ``data.*`` setting to change."""
    require(0 < data.val_fraction < 1, f"data.val_fraction={data.val_fraction} must be in (0, 1)")
    require(data.shard_chunk >= 0, f"data.shard_chunk={data.shard_chunk} must be >= 0 (0 = contiguous shards)")
    require(not (data.path and data.dataset), "set one of data.path (text files) and data.dataset (a HF dataset)")
    has_glob = any(char in data.dataset for char in "*?[")
    require(
        not data.dataset or has_glob or Path(data.dataset).expanduser().exists(),
        f"data.dataset={data.dataset!r} does not exist",
    )
    require(bool(data.text_field), "data.text_field must name the column that holds the text")
    require(
        not data.tokenizer or Path(data.tokenizer).expanduser().exists(),
        f"data.tokenizer={data.tokenizer!r} does not exist (a local folder or tokenizer.json; nothing is downloaded)",
    )
    # the token cache streams data.dataset or data.path; alone, it names a cache built before (checked
    # when the corpus loads: a machine may receive the cache after its config is checked)
    require(
        not Path(data.token_cache).expanduser().is_file(),
        f"data.token_cache={data.token_cache!r} is a file; it names a folder (created if missing)",
    )


def token_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest dtype that holds every id below ``vocab_size`` (in memory or in a token cache)."""
    if vocab_size <= 2**8:
        return torch.uint8
    return torch.uint16 if vocab_size <= 2**16 else torch.int32


def text_files(path: str) -> list[Path]:
    """The files ``data.path`` names: itself (a file), or its ``TEXT_SUFFIXES`` files in sorted order."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data.path {path!r} does not exist")
    if p.is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"data.path {path!r} is a folder with no {'/'.join(TEXT_SUFFIXES)} files")
    return files


def read_text(file: Path, path: str, cap: int = 0) -> bytes:
    """One of ``data.path``'s files (its first ``cap`` bytes, with a cap); ``DataError`` when it does
    not look like text (``MAX_CONTROL_FRACTION``), with what was read and the fix."""
    with file.open("rb") as handle:
        data = handle.read(cap) if cap else handle.read()
    sniffed = data[:SNIFF_BYTES]
    controls = len(sniffed) - len(sniffed.translate(None, CONTROL_BYTES))
    if controls > MAX_CONTROL_FRACTION * len(sniffed):
        where = f"data.path={path}" + ("" if file == Path(path).expanduser() else f": {file}")
        first = "first 64 KiB" if len(sniffed) == SNIFF_BYTES else f"{len(sniffed)} bytes"
        raise DataError(
            f"{where} does not look like text: {controls / len(sniffed):.0%} of its {first} are control bytes "
            "such as NUL, which text does not hold (a binary file?); point data.path at a text file"
        )
    return data


def truncate_documents(documents: list[bytes], max_bytes: int) -> list[bytes]:
    """The documents up to ``max_bytes`` bytes in total (the last one cut); all of them with 0."""
    if not max_bytes:
        return documents
    kept, total = [], 0
    for document in documents:
        if total >= max_bytes:
            break
        kept.append(document[: max_bytes - total])
        total += len(kept[-1])
    return kept


def describe_path(path: str, files: list[Path]) -> str:
    """How the source line names ``data.path``: the file, or how many text files under the folder."""
    where = Path(path).expanduser()
    return f"file {where}" if where.is_file() else f"{len(files)} text files under {where}"
