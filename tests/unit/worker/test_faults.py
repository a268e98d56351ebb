"""``faults.step_delay_s`` paces a worker until the file ``faults.step_delay_until`` names exists."""

from __future__ import annotations

from diloco.config import FaultConfig
from diloco.worker import faults


def test_a_paced_worker_sleeps_after_each_step_until_its_release_file_exists(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    release = tmp_path / "fault-over"
    cfg = FaultConfig(step_delay_s=0.25, step_delay_until=str(release))
    faults.slow_down(cfg, worker_index=0)
    release.touch()
    faults.slow_down(cfg, worker_index=0)
    assert slept == [0.25]


def test_the_delay_applies_only_to_the_named_worker(monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    cfg = FaultConfig(worker=1, step_delay_s=0.5)
    faults.slow_down(cfg, worker_index=0)
    faults.slow_down(cfg, worker_index=1)
    assert slept == [0.5]
