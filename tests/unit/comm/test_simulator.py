"""The in-process simulator: its link model, its averaging, and the data-parallel baseline."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco.comm.reduce import Contribution
from diloco.comm.simulator import SimulatedGroup, round_time_s
from diloco.compression import NoCompression, build_codec
from diloco.config import load_config
from diloco.core.inner import build_inner_optimizer, lr_at
from diloco.data.corpus import ShardSampler, load_corpus
from diloco.models.gpt import build_model
from diloco.tools.launcher import simulate
from diloco.worker.checkpoint import load_latest_checkpoint
from tests.conftest import TINY


def test_link_model_time_for_a_known_payload():
    # 4 workers, 10 MB: each uploads 2 * 3/4 * 10 MB = 15 MB = 120 Mbit; at 20 Mbit/s of which 1448/1514
    # are TCP payload, that is 6 s / 0.956
    assert round_time_s(10_000_000, 4, bandwidth_mbps=20, latency_ms=0) == pytest.approx(6.0 * 1514 / 1448)
    assert round_time_s(10_000_000, 2, bandwidth_mbps=80, latency_ms=50) == pytest.approx(1514 / 1448 + 0.1)
    assert round_time_s(10_000_000, 1, bandwidth_mbps=1, latency_ms=50) == 0.0


def test_group_returns_the_weighted_mean_to_every_worker():
    group, codec = SimulatedGroup(3), NoCompression()
    weights = [1.0, 1.0, 2.0]
    results = [None] * 3

    def worker(i):
        group.wait_turn(i)
        mine = Contribution(f"worker {i}", [codec.compress(torch.full((4,), float(i)))], weights[i])
        results[i] = group.all_reduce(i, mine, codec, [4])
        group.finish(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    for means, used in results:
        torch.testing.assert_close(means[0], torch.full((4,), (0 + 1 + 4) / 4))
        assert [c.weight for c in used] == weights


def test_data_parallel_baseline_equals_a_hand_written_data_parallel_loop(tmp_path):
    overrides = [
        *TINY,
        "comm.backend=simulator",
        "outer.sync_every=0",
        "inner.steps=2",
        "logging.eval_every=1",
        "checkpoint.every_rounds=1",
        "checkpoint.keep=5",
        f"run.dir={tmp_path}",
    ]
    cfg = load_config(None, overrides)
    summary = simulate(cfg, workers=2)
    assert summary["params_agree"] and summary["rounds"] == 2
    state = load_latest_checkpoint(tmp_path / "checkpoints", 0)

    # by hand: same init, each worker's batch, mean gradient, clip, AdamW at the scheduled lr
    corpus = load_corpus(cfg.data)
    samplers = [
        ShardSampler(
            corpus.train,
            block_size=cfg.model.block_size,
            batch_size=cfg.inner.batch_size,
            shard_index=i,
            num_shards=2,
            seed=cfg.seed,
        )
        for i in range(2)
    ]
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    optimizer = build_inner_optimizer(cfg.inner, model)
    for step in range(2):
        grads = []
        for sampler in samplers:
            model.zero_grad()
            _, loss = model(*sampler.next_batch())
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for param, a, b in zip(model.parameters(), *grads):
            param.grad = (a + b) / 2
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg.inner, step)
        optimizer.step()
    for name, param in model.state_dict().items():
        torch.testing.assert_close(state["model"][name], param, rtol=1e-5, atol=1e-6)


def test_simulated_run_reports_link_time_and_equal_params(tmp_path):
    cfg = load_config(
        None,
        [
            *TINY,
            "comm.backend=simulator",
            "inner.steps=20",
            "outer.sync_every=10",
            "comm.bandwidth_mbps=10",
            "comm.latency_ms=20",
            f"run.dir={tmp_path}",
            "checkpoint.every_rounds=0",
        ],
    )
    summary = simulate(cfg, workers=3)
    assert summary["workers"] == 3 and summary["params_agree"] and summary["rounds"] == 2
    payload = sum(NoCompression().payload_bytes(p.numel()) for p in build_model(cfg.model).parameters())
    expected = 2 * round_time_s(payload, 3, bandwidth_mbps=10, latency_ms=20)
    assert summary["comm_wait_s"] == pytest.approx(expected, rel=1e-3)
    assert summary["bytes_sent"] == 2 * int(2 * 2 / 3 * payload)


def test_a_simulated_sparseloco_run_agrees_and_counts_an_all_gather_of_its_payloads(tmp_path):
    cfg = load_config(
        None,
        [
            *TINY,
            "comm.backend=simulator",
            "outer.optimizer=sparseloco",
            "inner.steps=10",
            "outer.sync_every=10",
            f"run.dir={tmp_path}",
            "checkpoint.every_rounds=0",
        ],
    )
    summary = simulate(cfg, workers=3)
    assert summary["params_agree"] and summary["rounds"] == 1
    codec = build_codec(cfg.compression)
    payload = sum(codec.payload_bytes(p.numel()) for p in build_model(cfg.model).parameters())
    assert summary["bytes_sent"] == 2 * payload  # its payload to each of the 2 others: gathered, not reduced
