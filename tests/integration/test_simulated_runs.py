"""The simulator tells the truth: the same seed and config give the same global params over
hivemind (real processes) and the simulator; the compression benchmark's short form. (The quality
benchmark's short form and ``diloco plot`` run in tests/integration/test_examples.py.)"""

from __future__ import annotations

import json

import matplotlib.image
import pytest
import torch

from diloco.worker.checkpoint import read_checkpoint
from tests.conftest import TINY, read_records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _whole_start(run_dir) -> tuple[int, list]:
    """How many rounds from the first both workers averaged whole, and their round records."""
    rounds = [[r for r in read_records(run_dir, w) if r["event"] == "round"] for w in range(2)]
    whole = 0
    while whole < min(map(len, rounds)) and all(r[whole]["ok"] and r[whole]["peers"] == 2 for r in rounds):
        whole += 1
    return whole, rounds


def test_the_simulator_and_hivemind_agree_on_params_and_loss(tmp_path, diloco_cli):
    common = [*TINY, "inner.steps=30", "outer.sync_every=10", "checkpoint.every_rounds=1", "checkpoint.keep=5"]
    runs = {"simulator": tmp_path / "simulator", "hivemind": tmp_path / "hivemind"}
    done = diloco_cli("local", "--workers", "2", "--run-dir", str(runs["simulator"]), *common, "comm.backend=simulator")
    assert done.returncode == 0, done.stdout[-3000:]
    # compared after the last round of the run's unbroken start over hivemind: under load hivemind
    # can lose a round (a reducer's part, a group one peer never saw: seen in CI), which the
    # worker recovers from by taking a peer's state, and the simulator, which loses nothing, then
    # rightly differs. The first round is whole nearly always, but hivemind may lose a part of it
    # too; the test needs one whole round, so such a run is run once more
    for attempt in range(2):
        runs["hivemind"] = tmp_path / f"hivemind-{attempt}"
        done = diloco_cli("local", "--workers", "2", "--run-dir", str(runs["hivemind"]), *common)
        assert done.returncode == 0, done.stdout[-3000:]
        whole, rounds = _whole_start(runs["hivemind"])
        if whole:
            break
    assert whole >= 1, rounds
    name = f"round-{whole:06d}.pt"
    first = {b: read_checkpoint(run / "checkpoints" / "worker-0" / name) for b, run in runs.items()}
    real = torch.cat([p.flatten() for p in first["hivemind"]["outer"]["global_params"]])
    simulated = torch.cat([p.flatten() for p in first["simulator"]["outer"]["global_params"]])
    # relative to the size of the params: both ran the same arithmetic, up to the order of float sums
    # inside torch's kernels (one thread per process against two threads in turn) and of hivemind's
    # sums (in arrival order): seen up to 1.1e-5 after a few rounds
    assert ((simulated - real).norm() / real.norm()).item() < 5e-5
    losses = {
        b: next(r["val_loss"] for r in read_records(run, 0) if r["event"] == "round" and r["round"] == whole)
        for b, run in runs.items()
    }
    assert losses["simulator"] == pytest.approx(losses["hivemind"], rel=5e-3)


def test_short_compression_benchmark_orders_the_codecs_by_bytes(tmp_path, diloco_cli):
    out = tmp_path / "bench"
    arms = "dense,fp16,int8,int4,topk,sparseloco-paper,sparseloco"
    done = diloco_cli(
        "bench", "compression", "--steps", "50", "--seeds", "1", "--speed-values", "100000", "--out", str(out),
        "--arms", arms, *TINY,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    results = json.loads((out / "results.json").read_text())
    arms = results["arms"]
    assert sorted(arms) == sorted(["dense", "fp16", "int8", "int4", "topk", "sparseloco-paper", "sparseloco"])
    sent = [arms[name]["bytes_sent"] for name in ("dense", "fp16", "int8", "int4", "topk")]
    # top-k's payloads are all-gathered (3 x its payload against 1.5 x dense's): about 50 x fewer bytes
    assert sent == sorted(sent, reverse=True) and sent[-1] * 30 < sent[0]
    # the paper's density is top-k's (64 of 4096); the defaults send 184 of 4096 with shorter indices
    assert arms["sparseloco-paper"]["bytes_sent"] == pytest.approx(arms["topk"]["bytes_sent"], rel=0.2)
    assert 2 < arms["sparseloco"]["bytes_sent"] / arms["sparseloco-paper"]["bytes_sent"] < 3
    assert arms["dense"]["traffic_saving_vs_ddp"] == pytest.approx(50.0, rel=1e-3)  # H = 50, both fp32
    assert arms["int8"]["ratio_to_dense"] == pytest.approx(1.0, abs=0.01)  # 8 bits lose next to nothing
    assert set(results["codec_mb_s"]) == {"none", "fp16", "int8", "int4", "topk"}
    assert "| topk |" in done.stdout
    assert matplotlib.image.imread(out / "compression.png").shape[0] > 100
