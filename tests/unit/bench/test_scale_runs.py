"""``diloco bench scale``'s runs, their parts without processes: every size's overrides are real
keys, 300m is 302.7M parameters, a size this machine cannot hold is refused with diloco local's
line, the restart run's length, the first-step clock."""

from __future__ import annotations

import json

import pytest

from diloco.bench import scale_runs
from diloco.config import load_config


@pytest.mark.parametrize("size", sorted(scale_runs.SIZES))
def test_every_size_is_a_valid_config(size, tmp_path, monkeypatch):
    monkeypatch.setattr("diloco.config.checks.is_installed", lambda module: True)  # llama-150m: checked, not built
    overrides = scale_runs.training_overrides(size, steps=8, sync_every=2, run_dir=tmp_path)
    cfg = load_config(scale_runs.CONFIG, overrides)
    assert (cfg.inner.batch_size, cfg.inner.steps, cfg.outer.sync_every, cfg.checkpoint.every_rounds) == (2, 8, 2, 1)
    without = scale_runs.training_overrides(size, steps=8, sync_every=2, run_dir=tmp_path, checkpoints=False)
    assert load_config(scale_runs.CONFIG, without).checkpoint.every_rounds == 0
    assert cfg.comm.deadline_s == 900 and cfg.worker.threads == 1 and cfg.logging.log_every == 1
    assert cfg.model.block_size == (64 if size == "baby" else 128)


def test_the_300m_size_is_24_layers_of_1024_with_302_7m_parameters(tmp_path):
    from diloco.worker.memory import count_parameters

    cfg = load_config(scale_runs.CONFIG, scale_runs.training_overrides("300m", steps=8, sync_every=2, run_dir=tmp_path))
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd) == (24, 16, 1024)
    assert round(count_parameters(cfg.model, vocab_size=256) / 1e6, 1) == 302.7  # a byte vocabulary


def test_a_size_this_machine_cannot_hold_is_refused_with_the_line_diloco_local_would_say(tmp_path, monkeypatch):
    assert scale_runs.refusal("baby", tmp_path) is None
    monkeypatch.setattr("diloco.worker.memory.available_host_bytes", lambda: 1 << 20)  # 1 MiB free
    refused = scale_runs.refusal("baby", tmp_path)
    assert refused.startswith("refused: the model has ") and "2 workers on this machine need" in refused
    assert "\n" not in refused


def test_the_restart_run_has_three_rounds_at_least():
    assert scale_runs.restart_steps(4, 2) == 6 and scale_runs.restart_steps(8, 2) == 8


def test_the_first_step_clock_notes_when_each_worker_writes_a_step_record(tmp_path):
    with scale_runs.FirstStepClock(tmp_path, 2, poll_s=0.01) as clock:
        (tmp_path / "worker-1.jsonl").write_text(json.dumps({"event": "step", "step": 1}) + "\n")
        for _ in range(200):
            if clock.seconds[1] is not None:
                break
            clock._stop.wait(0.01)
    assert clock.seconds[0] is None and clock.seconds[1] is not None and clock.seconds[1] >= 0
