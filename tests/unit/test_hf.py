"""Hugging Face models and data: a Llama trains in DiLoCo workers, a local text dataset is tokenized
by a local tokenizer and sharded without overlap, and each mistake (a missing ``hf`` extra, an
unknown preset, a path that does not exist) is one line naming the key. Everything is built from
local files: nothing is downloaded."""

from __future__ import annotations

import json
import math
import random
import signal
import sys
from pathlib import Path

import pytest
import torch

from diloco.cli import main
from diloco.config import ConfigError, load_config
from diloco.data.corpus import DataError, ShardSampler, load_corpus, shard_bounds
from diloco.data.source import DataConfig
from diloco.models.config import ModelConfig
from diloco.models.gpt import build_model
from diloco.models.hf import HF_PRESETS
from diloco.optional_deps import is_installed
from diloco.tools.launcher import simulate

requires_hf = pytest.mark.skipif(
    not all(is_installed(module) for module in ("transformers", "datasets", "tokenizers")),
    reason="needs the hf extra: pip install 'diloco[hf]'",
)

WORDS = "the a worker round peer sends averages its pseudo gradient over slow links every inner step".split()  # noqa: SIM905
VOCAB = 300  # more than 256 ids, so the corpus needs 16-bit tokens
BLOCK = 16


def _lines(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE of VOCAB ids trained on this test's words, saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(_lines(200, seed=1), trainer)
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture
def text_files(tmp_path, monkeypatch):
    """Two text files of a few KB; the text builder reads them in name order, a row per line."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")  # not ~/.cache
    folder = tmp_path / "text"
    folder.mkdir()
    (folder / "b.txt").write_text("\n".join(_lines(150, seed=3)) + "\n")
    (folder / "a.txt").write_text("\n".join(_lines(150, seed=2)) + "\n")
    return folder


@requires_hf
def test_llama_tiny_on_a_tokenized_dataset_trains_in_two_workers_and_its_loss_falls(
    tmp_path, text_files, tokenizer_dir
):
    cfg = load_config(
        None,
        [
            "model.kind=hf",
            "model.hf_config=llama-tiny",
            "model.block_size=32",
            f"data.dataset={text_files}",
            f"data.tokenizer={tokenizer_dir}",
            "comm.backend=simulator",
            "inner.steps=30",
            "outer.sync_every=10",
            "inner.batch_size=8",
            "inner.warmup_steps=5",
            "inner.lr=3e-3",
            "logging.eval_batches=2",
            "logging.log_every=5",
            "checkpoint.every_rounds=0",
            f"run.dir={tmp_path / 'run'}",
        ],
    )
    summary = simulate(cfg, workers=2)
    assert summary["failed_workers"] == [] and summary["rounds"] == 3 and summary["params_agree"]
    # a uniform guess over the tokenizer's ids scores ln(VOCAB) = 5.7; a few words repeat a lot
    assert summary["final_val_loss"] < math.log(VOCAB) - 1.5


@requires_hf
def test_a_text_dataset_is_tokenized_in_order_and_sharded_without_overlap(text_files, tokenizer_dir):
    from diloco.data.hf import load_tokenizer

    corpus = load_corpus(DataConfig(dataset=str(text_files), tokenizer=str(tokenizer_dir), val_fraction=0.1))
    tokenizer = load_tokenizer(str(tokenizer_dir))
    text = (text_files / "a.txt").read_text() + (text_files / "b.txt").read_text()
    expected = [i for line in text.splitlines() for i in tokenizer.encode(line + "\n", add_special_tokens=False)]
    assert corpus.vocab_size == len(tokenizer) == VOCAB and corpus.train.dtype == torch.uint16
    assert torch.cat([corpus.train, corpus.val]).tolist() == expected

    # the same sampler as byte-level data: a twin over positions shows where each window came from
    seen = []
    for shard in range(3):

        def sampler(tokens, shard=shard):
            return ShardSampler(tokens, block_size=BLOCK, batch_size=8, shard_index=shard, num_shards=3, seed=0)

        tokens, positions = sampler(corpus.train), sampler(torch.arange(len(corpus.train)))
        start, end = shard_bounds(len(corpus.train), shard, 3)
        covered = set()
        for _ in range(10):
            (x, _), (where, _) = tokens.next_batch(), positions.next_batch()
            assert torch.equal(x, corpus.train[where].long())
            covered |= set(where.flatten().tolist())
        assert start <= min(covered) and max(covered) < end
        seen.append(covered)
    assert not (seen[0] & seen[1] or seen[1] & seen[2] or seen[0] & seen[2])


@requires_hf
def test_a_saved_dataset_is_read_from_its_split_and_column(tmp_path):
    from datasets import Dataset, DatasetDict

    splits = {
        name: Dataset.from_dict({"body": _lines(20, seed), "id": list(range(20))})
        for name, seed in [("train", 4), ("test", 5)]
    }
    DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))

    corpus = load_corpus(DataConfig(dataset=str(tmp_path / "saved"), split="test", text_field="body"))
    assert corpus.vocab_size == 256 and corpus.train.dtype == torch.uint8
    assert bytes(torch.cat([corpus.train, corpus.val]).tolist()).decode() == "".join(
        f"{line}\n" for line in _lines(20, 5)
    )
    with pytest.raises(DataError, match=r"data.text_field='text' is not a column .*columns: body, id"):
        load_corpus(DataConfig(dataset=str(tmp_path / "saved")))
    with pytest.raises(DataError, match=r"data.split='validation' is not a split .*train, test"):
        load_corpus(DataConfig(dataset=str(tmp_path / "saved"), split="validation", text_field="body"))


@requires_hf
def test_an_hf_model_takes_the_datas_vocabulary_and_gpts_interface(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="hf", hf_config="llama-tiny", block_size=BLOCK), vocab_size=VOCAB)
    x = torch.randint(0, VOCAB, (2, BLOCK))
    logits, loss = model(x, targets=x)
    assert logits.shape == (2, BLOCK, VOCAB) and loss.item() == pytest.approx(math.log(VOCAB), abs=0.5)
    assert model(x)[1] is None and model.training

    # a config.json of one's own: its vocabulary, too, gives way to the data's
    (tmp_path / "config.json").write_text(json.dumps({**HF_PRESETS["llama-tiny"], "vocab_size": 999}))
    from_file = build_model(ModelConfig(kind="hf", hf_config=str(tmp_path / "config.json")), vocab_size=VOCAB)
    assert from_file(x)[0].shape[-1] == VOCAB

    # pretrained weights from a local folder come back exactly
    model.hf.save_pretrained(tmp_path / "weights")
    loaded = build_model(ModelConfig(kind="hf", hf_weights=str(tmp_path / "weights")), vocab_size=VOCAB)
    assert loaded.training
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="model.hf_weights=.* has 300 token ids, fewer than the data's 512"):
        build_model(ModelConfig(kind="hf", hf_weights=str(tmp_path / "weights")), vocab_size=512)


@requires_hf
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.kind=llama"], r"model.kind='llama' is not one of gpt, hf"),
        (["model.kind=hf"], r"model.kind=hf needs one of model.hf_config .* or model.hf_weights"),
        (["model.kind=hf", "model.hf_config=llama-7b"], r"model.hf_config='llama-7b' is not a preset \(llama-tiny, "),
        (["model.kind=hf", "model.hf_config=/no/such/config.json"], r"model.hf_config='/no/such/config.json' does not"),
        (["model.kind=hf", "model.hf_weights=/no/such/model"], r"model.hf_weights='/no/such/model' is not a directory"),
        (["model.hf_config=llama-tiny"], r"model.hf_config and model.hf_weights apply to model.kind=hf only"),
        (["model.kind=hf", "model.hf_config=llama-tiny", "model.block_size=4096"], r"max_position_embeddings=1024"),
        (["data.tokenizer=/no/such/tokenizer"], r"data.tokenizer='/no/such/tokenizer' does not exist"),
        (["data.dataset=/no/such/dataset"], r"data.dataset='/no/such/dataset' does not exist"),
        (["data.dataset=/tmp", "data.path=/tmp"], r"set one of data.path .* and data.dataset"),
        (["data.dataset=/tmp", f"data.token_cache={__file__}"], r"data.token_cache=.* is a file; it names a folder"),
    ],
)
def test_bad_hf_settings_are_one_line_errors_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(None, overrides)
    assert "\n" not in str(error.value)


def test_settings_that_need_the_missing_extra_say_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    extra = r"needs the Hugging Face extra \((transformers|datasets) is not installed\): pip install 'diloco\[hf\]'"
    for setting, override in [
        ("model.kind=hf", "model.hf_config=llama-tiny"),
        ("data.tokenizer", f"data.tokenizer={tmp_path}"),
        ("data.dataset", f"data.dataset={tmp_path}"),
    ]:
        with pytest.raises(ConfigError, match=f"{setting} {extra}"):
            load_config(None, ["model.kind=hf" if setting.startswith("model") else "seed=0", override])
    with pytest.raises(ConfigError, match=f"model.kind=hf {extra}"):
        build_model(ModelConfig(kind="hf", hf_config="llama-tiny"))
    with pytest.raises(DataError, match=f"data.tokenizer {extra}"):
        load_corpus(DataConfig(tokenizer=str(tmp_path), max_bytes=1000))
    with pytest.raises(DataError, match=f"data.dataset {extra}"):
        load_corpus(DataConfig(dataset=str(tmp_path)))

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(["config", "model.kind=hf", "model.hf_config=llama-tiny"]) == 2
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("diloco: error: model.kind=hf needs the Hugging Face extra"), err


# --- data.token_cache: a streamed dataset, tokenized once into a memory-mapped file ---


def _mapped_file(tensor: torch.Tensor) -> str:
    """The file this process has mapped where ``tensor``'s data lies ("" for anonymous memory)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *fields = line.split(maxsplit=5)
        low, high = (int(end, 16) for end in span.split("-"))
        if low <= address < high:
            return fields[4] if len(fields) == 5 else ""
    return ""


def _cached(folder, text_files, tokenizer_dir="", **settings):
    return load_corpus(
        DataConfig(dataset=str(text_files), tokenizer=str(tokenizer_dir), token_cache=str(folder), **settings)
    )


def _stamp(path) -> tuple[int, int]:
    return path.stat().st_ino, path.stat().st_mtime_ns


@requires_hf
def test_a_token_cache_holds_the_in_memory_ids_mapped_from_disk_and_is_reused(tmp_path, text_files, tokenizer_dir):
    from diloco.data.corpus import val_batches

    in_memory = load_corpus(DataConfig(dataset=str(text_files), tokenizer=str(tokenizer_dir)))
    cached = _cached(tmp_path / "cache", text_files, tokenizer_dir)
    assert (cached.vocab_size, cached.train.dtype, cached.source) == (VOCAB, torch.uint16, in_memory.source)
    assert torch.equal(cached.train, in_memory.train) and torch.equal(cached.val, in_memory.val)
    tokens_file = tmp_path / "cache" / "tokens.bin"
    assert _mapped_file(cached.train) == _mapped_file(cached.val) == str(tokens_file)  # no copy in memory

    # sampling and evaluation only gather windows: the same batches as from memory
    sampler = {"block_size": BLOCK, "batch_size": 4, "shard_index": 1, "num_shards": 2, "seed": 0}
    from_cache, from_memory = ShardSampler(cached.train, **sampler), ShardSampler(in_memory.train, **sampler)
    assert all(map(torch.equal, from_cache.next_batch(), from_memory.next_batch()))
    evals = {"block_size": BLOCK, "batch_size": 4, "num_batches": 2}
    pairs = zip(val_batches(cached.val, **evals), val_batches(in_memory.val, **evals))
    assert all(torch.equal(a, b) for batch, twin in pairs for a, b in zip(batch, twin))

    before = _stamp(tokens_file)
    again = _cached(tmp_path / "cache", text_files, tokenizer_dir)
    assert _stamp(tokens_file) == before and torch.equal(again.train, in_memory.train)

    # data.max_bytes cuts the stream where it cuts the in-memory text (mid-batch here), and rebuilds
    cut = _cached(tmp_path / "cache", text_files, tokenizer_dir, max_bytes=1500)
    cut_in_memory = load_corpus(DataConfig(dataset=str(text_files), tokenizer=str(tokenizer_dir), max_bytes=1500))
    assert torch.equal(torch.cat([cut.train, cut.val]), torch.cat([cut_in_memory.train, cut_in_memory.val]))


def _cut_short(tokens_file) -> None:
    """Leave only the first 100 bytes, in a new file: truncating a mapped file would fault its readers."""
    head = tokens_file.read_bytes()[:100]
    tokens_file.unlink()
    tokens_file.write_bytes(head)


@requires_hf
def test_a_half_built_token_cache_is_rebuilt_never_used(tmp_path, text_files, tokenizer_dir):
    folder = tmp_path / "cache"
    whole = load_corpus(DataConfig(dataset=str(text_files), tokenizer=str(tokenizer_dir)))
    _cached(folder, text_files, tokenizer_dir)
    header = json.loads((folder / "tokens.json").read_text())
    (folder / "tokens.json").write_text(json.dumps({**header, "complete": False}))  # died before the marker
    _cut_short(folder / "tokens.bin")
    rebuilt = _cached(folder, text_files, tokenizer_dir)
    assert torch.equal(rebuilt.train, whole.train) and torch.equal(rebuilt.val, whole.val)
    assert json.loads((folder / "tokens.json").read_text()) == header

    _cut_short(folder / "tokens.bin")  # marked complete, but the file is not as long as its header says
    assert torch.equal(_cached(folder, text_files, tokenizer_dir).train, whole.train)


@requires_hf
def test_a_changed_tokenizer_or_source_rebuilds_the_token_cache(tmp_path, text_files, tokenizer_dir):
    folder = tmp_path / "cache"
    as_bytes = _cached(folder, text_files)
    text = (text_files / "a.txt").read_text() + (text_files / "b.txt").read_text()
    assert as_bytes.vocab_size == 256 and bytes(torch.cat([as_bytes.train, as_bytes.val]).tolist()).decode() == text

    tokenized = _cached(folder, text_files, tokenizer_dir)
    assert tokenized.vocab_size == VOCAB and tokenized.train.dtype == torch.uint16

    with open(text_files / "b.txt", "a") as more:
        more.write("one more line\n")
    grown = _cached(folder, text_files, tokenizer_dir)
    assert len(grown.train) + len(grown.val) > len(tokenized.train) + len(tokenized.val)


@requires_hf
def test_workers_starting_together_build_the_token_cache_once(tmp_path, text_files, tokenizer_dir, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from diloco.data import token_cache

    builds, build = [], token_cache._build
    monkeypatch.setattr(token_cache, "_build", lambda *args: builds.append(1) or build(*args))
    with ThreadPoolExecutor(3) as pool:  # flock excludes each open() of the lock file, threads included
        corpora = list(pool.map(lambda _: _cached(tmp_path / "cache", text_files, tokenizer_dir), range(3)))
    assert len(builds) == 1
    assert all(torch.equal(corpus.train, corpora[0].train) for corpus in corpora)
