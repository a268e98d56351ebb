"""Unit tests for diloco.data.corpus: corpus loading, disjoint resumable shards, fixed validation set."""

import pytest
import torch

from diloco.core.evaluation import evaluate
from diloco.data.corpus import (
    DataError,
    ShardSampler,
    embedded_corpus,
    load_corpus,
    shard_bounds,
    shard_regions,
    val_batches,
)
from diloco.data.source import DataConfig
from diloco.models.config import ModelConfig
from diloco.models.gpt import build_model

BLOCK = 8


def _positions(n: int) -> torch.Tensor:
    # Distinct values at every position (int64 so n may exceed 256) to see where windows came from.
    return torch.arange(n)


def _sampler(tokens: torch.Tensor, shard: int, num_shards: int = 3, seed: int = 0) -> ShardSampler:
    return ShardSampler(tokens, block_size=BLOCK, batch_size=16, shard_index=shard, num_shards=num_shards, seed=seed)


def test_shard_bounds_tile_the_tokens_without_gaps_or_overlap():
    bounds = [shard_bounds(1003, i, 4) for i in range(4)]
    assert bounds[0][0] == 0 and bounds[-1][1] == 1003
    for (_, end), (start, _) in zip(bounds, bounds[1:]):
        assert end == start


def test_workers_draw_windows_only_from_their_own_disjoint_region():
    tokens = _positions(3000)
    seen = []
    for shard in range(3):
        sampler = _sampler(tokens, shard)
        start, end = shard_bounds(len(tokens), shard, 3)
        covered = set()
        for _ in range(20):
            x, y = sampler.next_batch()
            covered |= set(x.flatten().tolist()) | set(y.flatten().tolist())
        assert min(covered) >= start and max(covered) < end
        seen.append(covered)
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])


def test_chunked_shards_are_dealt_round_robin_and_windows_stay_inside_one_chunk():
    tokens, chunk = _positions(3000), 100  # 30 chunks: shard s holds chunks s, s + 3, s + 6, ...
    seen = []
    for shard in range(3):
        starts, length = shard_regions(len(tokens), shard, 3, chunk)
        assert length == chunk and starts.tolist() == list(range(shard * chunk, 3000, 3 * chunk))
        sampler = ShardSampler(
            tokens, block_size=BLOCK, batch_size=16, shard_index=shard, num_shards=3, seed=0, chunk=chunk
        )
        covered = set()
        for _ in range(50):
            x, y = sampler.next_batch()
            window = torch.cat([x, y[:, -1:]], dim=1)
            assert ((window // chunk) % 3 == shard).all()  # every token from one of this shard's chunks
            assert (window[:, 0] // chunk == window[:, -1] // chunk).all()  # never across a chunk's end
            covered |= set((window[:, 0] // chunk).tolist())
        assert len(covered) == 10  # spread over the whole corpus, not one stretch of it
        seen.append(covered)
    assert not (seen[0] & seen[1] or seen[1] & seen[2] or seen[0] & seen[2])


def test_contiguous_shards_draw_the_very_windows_they_drew_before_chunks_existed():
    tokens = _positions(3000)
    start, end = shard_bounds(len(tokens), 1, 3)
    generator = torch.Generator().manual_seed(1_000_003 + 1)  # seed 1, shard 1, as the sampler mixes them
    before = torch.randint(start, end - BLOCK, (16,), generator=generator)
    x, _ = _sampler(tokens, 1, seed=1).next_batch()
    torch.testing.assert_close(x[:, 0], before)


def test_a_sampler_state_saved_before_chunks_existed_resumes_contiguous_shards():
    tokens = _positions(3000)
    original = _sampler(tokens, 2)
    original.next_batch()
    state = {key: value for key, value in original.state_dict().items() if key != "chunk"}
    resumed = _sampler(tokens, 2)
    resumed.load_state_dict(state)
    torch.testing.assert_close(resumed.next_batch(), original.next_batch())


def test_a_corpus_of_fewer_chunks_than_workers_falls_back_to_contiguous_shards():
    starts, length = shard_regions(1000, 1, 4, chunk=400)  # 2 whole chunks for 4 workers
    assert (starts.tolist(), length) == ([250], 250) == (shard_regions(1000, 1, 4)[0].tolist(), 250)


def test_targets_are_inputs_shifted_by_one():
    x, y = _sampler(_positions(3000), 1).next_batch()
    assert x.dtype == y.dtype == torch.int64
    assert x.shape == y.shape == (16, BLOCK)
    torch.testing.assert_close(y[:, :-1], x[:, 1:])
    torch.testing.assert_close(y[:, -1], x[:, -1] + 1)


def test_same_seed_and_shard_give_same_batches_other_shard_or_seed_differ():
    tokens = torch.randint(0, 256, (3000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    a, b = _sampler(tokens, 0), _sampler(tokens, 0)
    for _ in range(3):
        torch.testing.assert_close(a.next_batch(), b.next_batch())
    first = _sampler(tokens, 0).next_batch()[0]
    assert not torch.equal(first, _sampler(tokens, 1).next_batch()[0])
    assert not torch.equal(first, _sampler(tokens, 0, seed=1).next_batch()[0])


def test_resumed_sampler_continues_with_exactly_the_next_batches():
    tokens = _positions(3000)
    original = _sampler(tokens, 2)
    for _ in range(5):
        original.next_batch()
    state = original.state_dict()
    expected = [original.next_batch() for _ in range(3)]

    resumed = _sampler(tokens, 2)
    resumed.load_state_dict(state)
    assert resumed.batches_drawn == 5
    for want in expected:
        torch.testing.assert_close(resumed.next_batch(), want)
    assert resumed.batches_drawn == original.batches_drawn == 8


@pytest.mark.parametrize("chunk", [0, 100])
def test_a_skipped_sampler_draws_what_one_that_drew_as_many_batches_draws_next(chunk):
    tokens = _positions(3000)
    drawn, skipped = (
        ShardSampler(tokens, block_size=BLOCK, batch_size=16, shard_index=1, num_shards=3, seed=0, chunk=chunk)
        for _ in range(2)
    )
    for _ in range(7):
        drawn.next_batch()
    skipped.skip(7)
    assert skipped.batches_drawn == 7
    torch.testing.assert_close(skipped.next_batch(), drawn.next_batch())


def test_loading_state_from_another_shard_or_chunking_is_refused():
    tokens = _positions(3000)
    with pytest.raises(ValueError, match="shard_index"):
        _sampler(tokens, 0).load_state_dict(_sampler(tokens, 1).state_dict())
    chunked = ShardSampler(tokens, block_size=BLOCK, batch_size=16, shard_index=0, num_shards=3, seed=0, chunk=100)
    with pytest.raises(ValueError, match="shard_chunk"):
        _sampler(tokens, 0).load_state_dict(chunked.state_dict())


def test_shard_shorter_than_one_window_raises_data_error():
    with pytest.raises(DataError, match="too small"):
        _sampler(_positions(20), 0, num_shards=3)


def test_val_batches_are_identical_on_repeated_calls():
    tokens = torch.randint(0, 256, (500,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    a = val_batches(tokens, block_size=BLOCK, batch_size=4, num_batches=3)
    b = val_batches(tokens, block_size=BLOCK, batch_size=4, num_batches=3)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.shape == (4, BLOCK)
        torch.testing.assert_close(xa, xb)
        torch.testing.assert_close(ya, yb)


def test_evaluate_returns_mean_loss_and_restores_training_mode():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=BLOCK)
    model = build_model(cfg).train()
    tokens = torch.randint(0, 256, (500,), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    batches = val_batches(tokens, block_size=BLOCK, batch_size=4, num_batches=2)
    loss = evaluate(model, batches)
    assert model.training
    with torch.no_grad():
        model.eval()
        expected = sum(model(x, targets=y)[1].item() for x, y in batches) / 2
    assert loss == pytest.approx(expected)


def test_missing_path_raises_data_error_naming_it(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="nope.txt"):
        load_corpus(DataConfig(path=missing))


def test_empty_file_raises_data_error_naming_it(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty.txt"):
        load_corpus(DataConfig(path=str(empty)))


def test_folder_without_text_files_raises_data_error_naming_it(tmp_path):
    folder = tmp_path / "no_text_here"
    folder.mkdir()
    (folder / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(DataError, match="no_text_here"):
        load_corpus(DataConfig(path=str(folder)))


def test_folder_concatenates_text_files_in_sorted_order_and_splits_off_the_tail(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_bytes(b"B" * 50)
    (tmp_path / "a.txt").write_bytes(b"A" * 40)
    (tmp_path / "sub" / "c.py").write_bytes(b"C" * 10)
    (tmp_path / "skip.bin").write_bytes(b"X" * 10)
    corpus = load_corpus(DataConfig(path=str(tmp_path), val_fraction=0.1))
    assert bytes(corpus.train.tolist()) == b"A" * 40 + b"B" * 50
    assert bytes(corpus.val.tolist()) == b"C" * 10
    assert corpus.train.dtype == torch.uint8


def test_embedded_corpus_is_deterministic_nonempty_and_mostly_printable():
    a = load_corpus(DataConfig(max_bytes=200_000, val_fraction=0.1))
    b = load_corpus(DataConfig(max_bytes=200_000, val_fraction=0.1))
    assert len(a.train) + len(a.val) == 200_000
    assert len(a.val) == 20_000
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    data = bytes(a.train.tolist())
    printable = sum(32 <= c < 127 or c in (9, 10, 13) for c in data)
    assert printable / len(data) > 0.95
    assert embedded_corpus(200_000) == data + bytes(a.val.tolist())
