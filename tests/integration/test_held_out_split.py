"""Two real hivemind workers that hold the same params after a round split its held-out batches:
each evaluates about half, and both record the loss one worker evaluating every batch gets."""

from __future__ import annotations

import pytest
import torch

from diloco.config import load_config
from diloco.core.evaluation import evaluate
from diloco.data.corpus import load_corpus
from diloco.models.gpt import build_model
from diloco.worker.checkpoint import load_latest_checkpoint
from diloco.worker.lm_task import held_out_batches
from tests.conftest import TINY, log_tails, round_records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def _one_evaluation_of_every_batch(run_dir) -> float:
    """The held-out loss of worker 0's last checkpoint (its last round's params), every batch by this process."""
    cfg = load_config(run_dir / "config.yaml")
    corpus = load_corpus(cfg.data)
    held_out = held_out_batches(cfg, corpus.val)
    model = build_model(cfg.model, vocab_size=corpus.vocab_size)
    model.load_state_dict(load_latest_checkpoint(run_dir / "checkpoints", 0)["model"])
    return evaluate(model, held_out)


def test_two_workers_each_evaluate_half_the_batches_and_record_one_workers_loss(tmp_path, diloco_cli):
    run_dir = tmp_path / "run"
    done = diloco_cli(
        "local",
        "--workers",
        "2",
        "--run-dir",
        str(run_dir),
        *TINY,
        "logging.eval_batches=8",
        "inner.steps=20",
        "outer.sync_every=10",
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    first, second = round_records(run_dir, 0), round_records(run_dir, 1)
    why = f"{first}\n{second}\n{log_tails(run_dir, 2)}"
    assert len(first) == len(second) == 2, why
    assert [r["param_sha256"] for r in first] == [r["param_sha256"] for r in second], why
    assert [r["val_loss"] for r in first] == [r["val_loss"] for r in second], why
    # each evaluated its half (a share a loaded machine did not publish in time it evaluates itself)
    together = [(a["eval_batches"], b["eval_batches"]) for a, b in zip(first, second) if a["ok"] and b["ok"]]
    assert (4, 4) in together and all(4 <= n <= 8 for pair in together for n in pair), why
    assert all("evaluating" in r["phases_s"] for r in first + second), why
    torch.set_num_threads(1)  # as the workers ran (worker.threads=1): the same float sums
    assert first[-1]["val_loss"] == _one_evaluation_of_every_batch(run_dir), why  # bit for bit
