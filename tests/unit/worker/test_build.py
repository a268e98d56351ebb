"""A worker's set-up (logic only: the transport is a stand-in that records what was done to it)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from diloco.comm.base import Membership
from diloco.comm.simulator import SimulatedBackend
from diloco.config import load_config
from diloco.tools.launcher import simulate
from diloco.worker import build
from diloco.worker.build import build_worker
from diloco.worker.checkpoint import read_checkpoint
from diloco.worker.lm_task import build_task
from diloco.worker.run import Run
from tests.conftest import TINY


def _build(cfg):
    """``diloco train``'s worker set up around its model, as ``DiLoCo`` sets it up: (worker, task)."""
    run = Run.from_config(cfg)
    task = build_task(run)
    worker = build_worker(
        cfg,
        run.placement,
        task.model,
        task.inner_optimizer,
        synced_params=run.synced_params(task.model),
        extra={"sampler": task.sampler},
        samples_per_step=task.samples_per_step,
        tokens_per_step=task.tokens_per_step,
    )
    return worker, task


def test_a_set_up_step_that_fails_after_the_transport_started_stops_it_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(Membership, "leave", lambda self: calls.append("leave"))  # the simulator's membership
    monkeypatch.setattr(SimulatedBackend, "shutdown", lambda self: calls.append("shutdown"))

    def broken(*args, **kwargs):
        raise RuntimeError("the sync mode could not be built")

    monkeypatch.setattr(build, "_sync_mode", broken)
    cfg = load_config(None, [*TINY, "comm.backend=simulator", f"run.dir={tmp_path}"])
    with pytest.raises(RuntimeError, match="could not be built"):
        _build(cfg)
    assert calls == ["leave", "shutdown"]


def test_a_new_worker_starts_at_step_0_and_lists_every_part_of_its_checkpoint(tmp_path):
    cfg = load_config(None, [*TINY, "comm.backend=simulator", f"run.dir={tmp_path}"])
    worker, _ = _build(cfg)
    try:
        assert (worker.start_step, worker.start_round) == (0, 0)
        state = worker.state_dict(0, 0)
        parts = {"model", "inner_optimizer", "outer", "error_feedback", "overlap", "sampler", "rng"}
        assert parts | {"step", "round", "totals"} == set(state)
    finally:
        worker.close()


def test_a_worker_resuming_from_another_workers_checkpoint_takes_the_runs_state_and_keeps_its_own_data(tmp_path):
    overrides = [*TINY, "comm.backend=simulator", "comm.run_id=build_resume", "compression.name=topk"]
    cfg = load_config(None, [*overrides, "inner.steps=20", "outer.sync_every=5", f"run.dir={tmp_path}"])
    simulate(cfg, workers=2)
    newest = tmp_path / "checkpoints" / "worker-0" / "round-000004.pt"
    newest.write_bytes(newest.read_bytes()[:-10])
    theirs = read_checkpoint(tmp_path / "checkpoints" / "worker-1" / "round-000004.pt")
    assert theirs["error_feedback"]["residuals"] is not None  # top-k leaves a residual: worker 1's own

    worker, task = _build(replace(cfg, worker=replace(cfg.worker, index=0, count=2)))
    try:
        assert (worker.resume.source, worker.start_step, worker.start_round) == ("worker 1", 20, 4)
        for mine, saved in zip(worker.trained.outer.global_params, theirs["outer"]["global_params"], strict=True):
            assert torch.equal(mine, saved)
        assert worker.trained.error_feedback.residuals is None
        task.follow(worker.resume)
        assert (task.sampler.shard_index, task.sampler.batches_drawn) == (0, theirs["sampler"]["batches_drawn"])
    finally:
        worker.close()
