"""``diloco corpus OUT_DIR``: a real corpus, offline. The installed packages' Python source is
collected into text shards (``OUT_DIR/text``), a byte-level BPE is trained on them
(``OUT_DIR/tokenizer.json``), and they are tokenized once into a token cache (``OUT_DIR/cache``)
that any run then memory-maps with ``data.token_cache=OUT_DIR/cache`` (alone, or with
``data.path=OUT_DIR/text data.tokenizer=OUT_DIR/tokenizer.json``).

Each step reuses what a previous run left when its inputs have not changed: the shards (same files,
sizes and mtimes), the tokenizer (same shard digest and vocabulary, recorded in
``OUT_DIR/tokenizer.source.json``), and the cache (its own header).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from diloco.data.pysource import TEXT_DIR, collect_python_sources, train_bpe_tokenizer
from diloco.data.source import DataConfig
from diloco.data.token_cache import load_token_cache
from diloco.errors import DataError, make_folder

logger = logging.getLogger(__name__)

TOKENIZER_FILE, TOKENIZER_SOURCE_FILE, CACHE_DIR = "tokenizer.json", "tokenizer.source.json", "cache"


def _tokenizer(out: Path, manifest: dict[str, Any], vocab_size: int) -> Path:
    """``OUT_DIR/tokenizer.json``, trained unless one was trained on the same shards with the same vocabulary."""
    path, source_file = out / TOKENIZER_FILE, out / TOKENIZER_SOURCE_FILE
    source = {"text_sha256": manifest["sha256"], "vocab_size": vocab_size}
    try:
        reusable = path.is_file() and json.loads(source_file.read_text()) == source
    except (OSError, ValueError):
        reusable = False
    if reusable:
        logger.info("tokenizer: reusing %s (same shards, %d ids)", path, vocab_size)
        return path
    source_file.unlink(missing_ok=True)
    train_bpe_tokenizer(out / TEXT_DIR, path, vocab_size)
    source_file.write_text(json.dumps(source, indent=2) + "\n")
    return path


def build_corpus(out_dir: str, *, vocab_size: int = 32768, max_bytes: int = 0) -> dict[str, Any]:
    """Collect, train, tokenize (each step skipped if already done); a summary of the corpus."""
    started = time.monotonic()
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise DataError(f"OUT_DIR {out_dir!r} is a file; the corpus goes in a folder (created if missing)")
    if max_bytes < 0:
        raise DataError(f"--max-bytes={max_bytes} must be >= 0 (0 = all of it)")
    make_folder(out, "OUT_DIR", DataError)
    manifest = collect_python_sources(out, max_bytes=max_bytes)
    tokenizer = _tokenizer(out, manifest, vocab_size)
    cfg = DataConfig(path=str(out / TEXT_DIR), tokenizer=str(tokenizer), token_cache=str(out / CACHE_DIR))
    tokens, vocab, _ = load_token_cache(cfg)
    return {
        "out_dir": str(out),
        "files": manifest["files"],
        "bytes": manifest["bytes"],
        "tokens": len(tokens),
        "vocab_size": vocab,
        "dtype": str(tokens.dtype).removeprefix("torch."),
        "seconds": time.monotonic() - started,
        "cache": cfg.token_cache,
    }


def summary_line(summary: dict[str, Any]) -> str:
    """``diloco corpus``'s last line: what ``build_corpus`` made, and how to train on it."""
    return (
        f"corpus {summary['out_dir']}: {summary['files']} files, {summary['bytes'] / 1e6:.1f} MB of text, "
        f"{summary['tokens']} tokens ({summary['dtype']}), vocab {summary['vocab_size']}, "
        f"in {summary['seconds']:.0f} s; train with data.token_cache={summary['cache']}"
    )
