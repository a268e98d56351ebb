"""A worker's set-up (logic only: the transport is a stand-in that records what was done to it)."""

from __future__ import annotations

import pytest

from diloco.comm.base import Membership
from diloco.comm.simulator import SimulatedBackend
from diloco.config import load_config
from diloco.worker import build
from diloco.worker.build import build_worker
from tests.conftest import TINY


def test_a_set_up_step_that_fails_after_the_transport_started_stops_it_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(Membership, "leave", lambda self: calls.append("leave"))  # the simulator's membership
    monkeypatch.setattr(SimulatedBackend, "shutdown", lambda self: calls.append("shutdown"))

    def broken(*args, **kwargs):
        raise RuntimeError("the sync mode could not be built")

    monkeypatch.setattr(build, "_sync_mode", broken)
    cfg = load_config(None, [*TINY, "comm.backend=simulator", f"run.dir={tmp_path}"])
    with pytest.raises(RuntimeError, match="could not be built"):
        build_worker(cfg)
    assert calls == ["leave", "shutdown"]


def test_a_new_worker_starts_at_step_0_and_lists_every_part_of_its_checkpoint(tmp_path):
    cfg = load_config(None, [*TINY, "comm.backend=simulator", f"run.dir={tmp_path}"])
    worker = build_worker(cfg)
    try:
        assert (worker.start_step, worker.start_round) == (0, 0)
        state = worker.state_dict(0, 0)
        parts = {"model", "inner_optimizer", "outer", "error_feedback", "overlap", "sampler", "rng"}
        assert parts | {"step", "round", "totals"} == set(state)
    finally:
        worker.close()
