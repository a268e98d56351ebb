"""``diloco.DiLoCo`` around a loop of the test's own: a small MLP, plain SGD, one simulated worker
(its rounds average with itself: what counts here is when they happen and what they record)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import diloco
from diloco.errors import UsageError

# one worker over the simulator: no network; records every step; a checkpoint every round
BASE = {
    "comm": {"backend": "simulator", "run_id": "wrapper"},
    "inner": {"steps": 10, "batch_size": 4},
    "outer": {"sync_every": 4},
    "logging": {"log_every": 1},
    "checkpoint": {"every_rounds": 1},
}


def _run(tmp_path: Path, *overrides: str, **sections) -> diloco.Run:
    return diloco.init(None, f"run.dir={tmp_path}", *overrides, **{**BASE, **sections})


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch for the same step, in any process."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(4, 3, generator=generator)
    return x, x.sum(dim=1, keepdim=True)


def _train_step(model: nn.Module, inner: torch.optim.Optimizer, step: int) -> torch.Tensor:
    x, y = _batch(step)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    inner.step()
    inner.zero_grad()
    return loss


def _records(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "worker-0.jsonl").read_text().splitlines()
    return [record for line in lines if (record := json.loads(line))["event"] == event]


def _digest(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("hook", [True, False])
def test_a_round_ends_every_sync_every_steps_and_at_the_last_step_with_the_hook_on_or_off(tmp_path, hook):
    model, inner = _model()
    with diloco.DiLoCo(_run(tmp_path), model, inner, hook=hook) as dl:
        while dl.running:
            loss = _train_step(model, inner, dl.inner_steps)
            if not hook:
                dl.after_step()
            dl.log(loss=loss)
    assert [r["step"] for r in _records(tmp_path, "round")] == [4, 8, 10]
    steps = _records(tmp_path, "step")
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert all(isinstance(r["loss"], float) and r["lr"] == 0.1 for r in steps)  # the optimizer's lr, recorded
    assert (dl.result["inner_steps"], dl.result["rounds"]) == (10, 3)


def test_the_hook_is_gone_once_the_block_is_left(tmp_path):
    model, inner = _model()
    with diloco.DiLoCo(_run(tmp_path, "inner.steps=2", "outer.sync_every=2"), model, inner) as dl:
        while dl.running:
            _train_step(model, inner, dl.inner_steps)
    _train_step(model, inner, 99)  # the user's optimizer steps on, without diloco
    assert dl.inner_steps == 2


def test_timed_rounds_end_by_the_clock_and_the_run_has_ceil_steps_over_h_of_them(tmp_path):
    model, inner = _model()
    run = _run(tmp_path, "outer.round_s=1e-9")  # every step outlasts its round's budget
    with diloco.DiLoCo(run, model, inner) as dl:
        while dl.running:
            _train_step(model, inner, dl.inner_steps)
    assert [r["step"] for r in _records(tmp_path, "round")] == [1, 2, 3]  # ceil(10 / 4) rounds


def test_a_loop_that_stops_early_averages_its_part_round_on_leaving_and_checkpoints_it(tmp_path):
    model, inner = _model()
    with diloco.DiLoCo(_run(tmp_path), model, inner):
        for step in range(6):
            _train_step(model, inner, step)
    assert [r["step"] for r in _records(tmp_path, "round")] == [4, 6]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "worker-0").glob("*.pt"))[-1] == "round-000002.pt"


def test_a_rerun_resumes_the_users_model_optimizer_and_state_bit_exactly(tmp_path):
    """Stopped by an error after its first round, then rerun: it ends on the very params of a run never stopped."""

    class Position:
        def __init__(self):
            self.batches = 0

        def state_dict(self):
            return {"batches": self.batches}

        def load_state_dict(self, state):
            self.batches = state["batches"]

    def train(run_dir: Path, *, stop_at: int | None = None) -> tuple[list[torch.Tensor], int]:
        model, inner = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)  # a state of its own to resume
        position = Position()
        # a simulated group lives as long as this process: each life of the worker its own, as in a process of its own
        run = _run(run_dir, f"comm.run_id=resume_{stop_at}_{(run_dir / 'checkpoints').exists()}")
        with diloco.DiLoCo(run, model, inner, state={"position": position}) as dl:
            started = dl.inner_steps
            while dl.running:
                if dl.inner_steps == stop_at:
                    raise RuntimeError("stopped")
                position.batches += 1  # drawn before the step, as a data loader's position moves
                _train_step(model, inner, position.batches)
        return _digest(model), started

    whole, _ = train(tmp_path / "whole")
    with pytest.raises(RuntimeError, match="stopped"):
        train(tmp_path / "stopped", stop_at=6)
    resumed, started = train(tmp_path / "stopped")
    assert started == 4  # the checkpoint after round 1
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))


def test_using_the_wrapper_outside_its_block_is_one_line_naming_the_fix(tmp_path):
    model, inner = _model()
    dl = diloco.DiLoCo(_run(tmp_path), model, inner)
    with pytest.raises(UsageError, match="outside `with DiLoCo"):
        dl.after_step()
    with dl:
        pass
    with pytest.raises(UsageError, match="outside `with DiLoCo"):
        dl.log(loss=1.0)
    with pytest.raises(UsageError, match="entered once"):
        dl.__enter__()


def test_stepping_past_inner_steps_is_one_line_naming_the_fix(tmp_path):
    model, inner = _model()
    dl = diloco.DiLoCo(_run(tmp_path, "inner.steps=2"), model, inner)
    with pytest.raises(UsageError, match=r"past the run's end \(inner.steps=2\).*loop while dl.running"), dl:
        for step in range(3):
            _train_step(model, inner, step)
    assert dl.result is None  # left on the error: no end record


def test_a_model_whose_parameters_changed_is_refused_at_the_rounds_end(tmp_path):
    model, inner = _model()
    dl = diloco.DiLoCo(_run(tmp_path), model, inner)
    with pytest.raises(UsageError, match="parameters changed after DiLoCo started"), dl:
        _train_step(model, inner, 0)
        model[2] = nn.Linear(8, 2)
        while dl.running:
            inner.step()


def test_an_optimizer_without_step_hooks_asks_for_after_step(tmp_path):
    class Bare:
        param_groups = [{"lr": 1.0}]

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    model, _ = _model()
    dl = diloco.DiLoCo(_run(tmp_path), model, Bare())
    with pytest.raises(UsageError, match=r"has no step hooks: pass hook=False .* dl.after_step\(\)"), dl:
        pass


def test_init_layers_the_scripts_defaults_its_file_its_overrides_and_the_launchers_environment(tmp_path, monkeypatch):
    config = tmp_path / "run.yaml"
    config.write_text("outer:\n  sync_every: 7\ninner:\n  steps: 70\n")
    sections = {"outer": {"sync_every": 8}, "inner": {"batch_size": 5}, "comm.run_id": "mine", "seed": 3}
    run = diloco.init(config, "inner.steps=80", **sections)
    cfg = run.config
    assert (cfg.outer.sync_every, cfg.inner.steps, cfg.inner.batch_size, cfg.comm.run_id) == (7, 80, 5, "mine")
    assert cfg.seed == 3
    launched = tmp_path / "launched.yaml"  # diloco launch's file (a volunteer's: the run's own) replaces the script's
    launched.write_text("inner:\n  steps: 90\n")
    launch = diloco.config.launch_env.Launch(str(launched), ("outer.sync_every=9", "worker.index=1", "worker.count=3"))
    monkeypatch.setenv(*next(iter(launch.to_environment().items())))
    cfg = diloco.init(config, **sections).config
    assert (cfg.outer.sync_every, cfg.inner.steps, cfg.inner.batch_size, cfg.worker.index) == (9, 90, 5, 1)
    run = diloco.init(config, "worker.slots=4", **sections)
    assert (run.data_index, run.data_count) == (1, 4)  # one shard a slot: a volunteer's is its own


def test_init_refuses_a_keyword_that_is_no_section_in_one_line():
    with pytest.raises(diloco.config.ConfigError, match=r"diloco.init\(steps=...\) is not a setting of the config"):
        diloco.init(steps=3)


def test_a_state_object_that_would_replace_a_checkpoints_part_or_cannot_be_saved_is_refused_in_one_line(tmp_path):
    model, inner = _model()
    with pytest.raises(UsageError, match=r"'model' is a part of diloco's own checkpoint; pick another name"):
        diloco.DiLoCo(_run(tmp_path), model, inner, state={"model": model})
    with pytest.raises(UsageError, match=r"a list has no state_dict\(\)/load_state_dict\(\)"):
        diloco.DiLoCo(_run(tmp_path), model, inner, state={"seen": []})


def test_sigterm_inside_the_block_leaves_as_ctrl_c_does_and_the_default_is_back_after(tmp_path):
    import os
    import signal

    model, inner = _model()
    earlier = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Python's default, whatever an earlier test left
    try:
        with pytest.raises(KeyboardInterrupt), diloco.DiLoCo(_run(tmp_path), model, inner):
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, earlier)
    assert [r["event"] for r in _records(tmp_path, "end")] == []  # left: no end record


def test_init_takes_a_first_argument_of_key_value_as_an_override(tmp_path):
    assert diloco.init("inner.steps=3", "outer.sync_every=1").config.inner.steps == 3


def test_init_merges_a_sections_keywords_whatever_their_order():
    run = diloco.init(**{"comm.hivemind.port": 4242}, comm={"hivemind": {"matchmaking_s": 9.0}})
    assert (run.config.comm.hivemind.port, run.config.comm.hivemind.matchmaking_s) == (4242, 9.0)


def test_a_script_as_one_of_several_simulated_workers_is_refused_in_one_line():
    with pytest.raises(diloco.config.ConfigError, match="simulator runs a run's workers as threads of one process"):
        diloco.init(comm={"backend": "simulator"}, worker={"count": 2})


def test_a_manual_count_beside_the_hook_a_log_field_of_the_record_and_a_foreign_optimizer_are_refused(tmp_path):
    model, inner = _model()
    with diloco.DiLoCo(_run(tmp_path), model, inner) as dl:
        with pytest.raises(UsageError, match="would count each step twice"):
            dl.after_step()
        with pytest.raises(UsageError, match=r"dl.log\(step=...\): 'step' is a field of the record"):
            dl.log(step=3)
    other, _ = _model()
    with pytest.raises(UsageError, match="steps params that are not the model's"):
        diloco.DiLoCo(_run(tmp_path / "b"), model, torch.optim.SGD(other.parameters(), lr=0.1)).__enter__()


def test_a_loop_stopped_at_a_rounds_end_between_checkpoints_checkpoints_it_on_leaving(tmp_path):
    model, inner = _model()
    with diloco.DiLoCo(_run(tmp_path, "checkpoint.every_rounds=2"), model, inner):
        for step in range(4):  # round 1 ends at step 4: not a checkpoint round of every_rounds=2
            _train_step(model, inner, step)
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "worker-0").glob("*.pt")) == ["round-000001.pt"]
