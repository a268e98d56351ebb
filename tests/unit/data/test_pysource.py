"""A real corpus offline: Python source collected into deterministic shards, a byte-level BPE trained
on them, and a token cache built from ``data.path`` (no ``datasets`` package) that holds the ids
the in-memory path gives; ``data.token_cache`` alone uses that cache as built, and a missing one is a
one-line error naming the key."""

from __future__ import annotations

import hashlib
import signal
import sys

import pytest
import torch

from diloco.cli import main
from diloco.config import load_config
from diloco.data.corpus import DataError, load_corpus
from diloco.data.pysource import collect_python_sources, train_bpe_tokenizer
from diloco.data.source import DataConfig
from diloco.optional_deps import is_installed

pytestmark = pytest.mark.skipif(not is_installed("tokenizers"), reason="needs tokenizers: pip install 'diloco[hf]'")

VOCAB = 300
SOURCES = {
    "pkg/__init__.py": "from pkg.core import run\n",
    "pkg/core.py": "def run(x):\n    if x:\n        return x + 1\n    return 0\n" * 20,
    "pkg/sub/util.py": "class Peer:\n    def send(self, grads):\n        return sum(grads)\n" * 15,
    "pkg/latin1.py": None,  # not UTF-8: skipped
    "other.py": "# no newline at the end",
    "notes.txt": "not python, left out\n",
}


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """Sources collected into small shards, and a tiny BPE trained on them."""
    root = tmp_path_factory.mktemp("site")
    for name, text in SOURCES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"caf\xe9 = 1\n" if text is None else text.encode())
    out = tmp_path_factory.mktemp("corpus")
    collect_python_sources(out, [root], shard_bytes=1500)
    train_bpe_tokenizer(out / "text", out / "tokenizer.json", vocab_size=VOCAB)
    return root, out


def test_collect_is_deterministic_and_skips_what_is_not_utf8(corpus_dir, tmp_path):
    root, out = corpus_dir
    again = collect_python_sources(tmp_path / "again", [root], shard_bytes=1500)
    assert len(again["shards"]) > 1 and again["files"] == 4 and again["skipped_not_utf8"] == ["pkg/latin1.py"]
    for shard in again["shards"]:
        assert (tmp_path / "again" / "text" / shard["name"]).read_bytes() == (out / "text" / shard["name"]).read_bytes()
    assert (tmp_path / "again" / "manifest.json").read_bytes() == (out / "manifest.json").read_bytes()
    text = b"".join(path.read_bytes() for path in sorted((out / "text").glob("*.txt"))).decode()
    order = [line.removeprefix("# file: ") for line in text.splitlines() if line.startswith("# file: ")]
    assert order == sorted(order, key=lambda name: hashlib.sha256(name.encode()).hexdigest())  # a fixed shuffle
    assert "# file: other.py\n# no newline at the end\n# file: " in text

    stamp = (out / "text" / "shard-00000.txt").stat().st_mtime_ns
    assert collect_python_sources(out, [root], shard_bytes=1500)["sha256"] == again["sha256"]  # reused, not rewritten
    assert (out / "text" / "shard-00000.txt").stat().st_mtime_ns == stamp


def test_training_the_tokenizer_twice_gives_the_same_file(corpus_dir, tmp_path):
    _, out = corpus_dir
    train_bpe_tokenizer(out / "text", tmp_path / "tokenizer.json", vocab_size=VOCAB)
    assert (tmp_path / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()


def test_a_cache_built_from_a_data_path_holds_the_in_memory_ids(corpus_dir, tmp_path, monkeypatch):
    _, out = corpus_dir
    monkeypatch.setitem(sys.modules, "datasets", None)  # data.path never needs it
    monkeypatch.setitem(sys.modules, "transformers", None)  # nor does a tokenizer.json
    settings = {"path": str(out / "text"), "tokenizer": str(out / "tokenizer.json")}
    in_memory = load_corpus(DataConfig(**settings))
    cached = load_corpus(DataConfig(**settings, token_cache=str(tmp_path / "cache")))
    assert (cached.vocab_size, cached.train.dtype, cached.source) == (VOCAB, torch.uint16, in_memory.source)
    assert torch.equal(cached.train, in_memory.train) and torch.equal(cached.val, in_memory.val)

    cut = load_corpus(DataConfig(**settings, max_bytes=1000, token_cache=str(tmp_path / "cut")))
    cut_in_memory = load_corpus(DataConfig(**settings, max_bytes=1000))
    assert torch.equal(torch.cat([cut.train, cut.val]), torch.cat([cut_in_memory.train, cut_in_memory.val]))

    as_bytes = load_corpus(DataConfig(path=str(out / "text"), token_cache=str(tmp_path / "bytes")))
    text = b"".join(path.read_bytes() for path in sorted((out / "text").glob("*.txt")))
    assert as_bytes.vocab_size == 256 and bytes(torch.cat([as_bytes.train, as_bytes.val]).tolist()) == text

    # the cache alone, its source gone: used as built
    prebuilt = load_corpus(DataConfig(token_cache=str(tmp_path / "cache")))
    assert torch.equal(prebuilt.train, in_memory.train) and prebuilt.source == in_memory.source
    assert load_config(None, [f"data.token_cache={tmp_path / 'cache'}"]).data.token_cache  # a valid config


def test_a_missing_or_incomplete_prebuilt_cache_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(DataError, match=r"data.token_cache='.*' does not exist .*diloco corpus OUT_DIR") as error:
        load_corpus(DataConfig(token_cache=str(tmp_path / "none")))
    assert "\n" not in str(error.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data.token_cache='.*' holds no complete token cache") as error:
        load_corpus(DataConfig(token_cache=str(tmp_path / "empty")))
    assert "\n" not in str(error.value)


def test_the_corpus_command_rejects_a_file_in_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(["corpus", str(tmp_path / "file")]) == 2
        assert main(["corpus", str(tmp_path / "out"), "--vocab", "100"]) == 2
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "is a file" in err[0] and "--vocab=100" in err[1]


def test_waiting_for_another_builder_of_the_cache_is_bounded(tmp_path):
    import fcntl

    from diloco.data.token_cache import _lock_within

    lock = tmp_path / "tokens.lock"
    with open(lock, "a") as builder, open(lock, "a") as waiter:
        fcntl.flock(builder, fcntl.LOCK_EX)  # another process building the cache (flock is per open file)
        with pytest.raises(DataError, match="another process has been building it for over"):
            _lock_within(waiter, tmp_path, limit_s=0.6)
        fcntl.flock(builder, fcntl.LOCK_UN)
        _lock_within(waiter, tmp_path, limit_s=0.6)  # free: taken at once
