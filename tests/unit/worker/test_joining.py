"""Unit tests for diloco.worker.joining.catch_up_with_run: where a worker that starts behind a live run
begins (the transport is scripted; the real one is exercised in tests/integration/test_volunteer.py)."""

from __future__ import annotations

import pytest

from diloco.comm.base import Membership, PeerState, StateExchange, StateRank
from diloco.comm.members import PROTOCOL, PROTOCOL_KEY, LiveWorker
from diloco.config import ConfigError, load_config
from diloco.core.recovery import Recovery
from diloco.worker.joining import catch_up_with_run, model_digest, published_run


class _Outer:
    def __init__(self) -> None:
        self.loaded = None

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


class _Transport(StateExchange, Membership):
    """Live peers at ``round`` (rounds completed) and ``step``, serving the state after ``served``."""

    def __init__(self, *, round: int, step: int, served: int) -> None:
        self.others = {i: LiveWorker(index=i, round=round, step=step) for i in (0, 1)}
        self.served = served
        self.progress = []

    def live_workers(self) -> dict:
        return self.others

    def fetch_state(self, after_round, *, better_than, timeout_s, newer, check=None):
        return PeerState(round=self.served, rank=StateRank(2), state={"round": self.served})

    def report_progress(self, round_index: int, step: int, stats=None) -> None:
        self.progress.append((round_index, step))


def _catch_up(backend: _Transport, outer: _Outer, *, step: int, round_index: int) -> tuple[int, int]:
    cfg = load_config(None, ["worker.count=3", "worker.index=2", "outer.sync_every=20", "inner.steps=200"])
    return catch_up_with_run(Recovery(outer, backend, backend), backend, step, round_index, cfg=cfg, required=False,
                             align_step=True)  # fmt: skip


def test_a_restart_behind_the_run_takes_the_state_and_starts_where_the_others_are():
    backend, outer = _Transport(round=5, step=110, served=4), _Outer()  # rounds 0-4 done, 10 steps into round 5
    assert _catch_up(backend, outer, step=40, round_index=2) == (110, 5)
    assert outer.loaded == {"round": 4} and backend.progress == [(5, 110)]


def test_a_restart_that_finds_the_runs_final_state_has_nothing_left_to_train():
    # the peers finished their last round (10 of 200 / 20) and have not left yet: the restart takes
    # that state and ends with it, rather than training one more step and averaging alone
    backend, outer = _Transport(round=10, step=200, served=9), _Outer()
    assert _catch_up(backend, outer, step=40, round_index=2) == (200, 10)
    assert outer.loaded == {"round": 9} and backend.progress == [(10, 200)]


def test_a_newcomer_whose_model_differs_from_the_runs_is_stopped_in_one_line_before_any_download():
    cfg = load_config(None, ["worker.count=3", "worker.index=2", "model.n_embd=64"])
    backend, outer = _Transport(round=5, step=110, served=4), _Outer()
    run = published_run(load_config(None, ["model.n_embd=128"]))
    backend.others = {i: LiveWorker(index=i, round=5, step=110, run=run) for i in (0, 1)}
    with pytest.raises(ConfigError) as error:
        catch_up_with_run(Recovery(outer, backend, backend), backend, 0, 0, cfg=cfg, required=True, align_step=True)
    assert str(error.value) == (
        "this worker's config differs from that of run 'diloco': model.n_embd=64 here, 128 in the run; "
        "join with the run's settings (its config.yaml)"
    )
    assert outer.loaded is None  # nothing was downloaded


def test_a_worker_whose_own_model_differs_from_the_runs_is_stopped_in_one_line_before_any_download():
    from torch import nn

    from diloco.worker.resume import model_shapes

    def digest(width: int) -> str:
        return model_digest(model_shapes(nn.Sequential(nn.Linear(3, width), nn.Linear(width, 1))))

    cfg = load_config(None, ["worker.count=3", "worker.index=2"])
    backend, outer = _Transport(round=5, step=110, served=4), _Outer()
    run = published_run(cfg, model=digest(8))
    backend.others = {i: LiveWorker(index=i, round=5, step=110, run=run) for i in (0, 1)}
    with pytest.raises(ConfigError, match="this worker's model differs from that of run 'diloco'.*same model"):
        catch_up_with_run(
            Recovery(outer, backend, backend), backend, 0, 0, cfg=cfg, required=True, align_step=True, model=digest(16)
        )
    assert outer.loaded is None  # nothing was downloaded


def test_a_worker_that_would_screen_by_other_rules_than_the_run_is_stopped_in_one_line():
    cfg = load_config(None, ["worker.count=3", "worker.index=2"])  # comm.trust=trusted
    backend, outer = _Transport(round=5, step=110, served=4), _Outer()
    run = published_run(load_config(None, ["comm.trust=open"]))
    backend.others = {i: LiveWorker(index=i, round=5, step=110, run=run) for i in (0, 1)}
    with pytest.raises(ConfigError, match="comm.trust='trusted' here, 'open' in the run"):
        catch_up_with_run(Recovery(outer, backend, backend), backend, 0, 0, cfg=cfg, required=True, align_step=True)


def test_a_worker_of_another_release_is_stopped_in_one_line_before_any_download():
    # its records would not be read by the run's workers, nor theirs by it
    cfg = load_config(None, ["worker.count=3", "worker.index=2"])
    backend, outer = _Transport(round=5, step=110, served=4), _Outer()
    older = {key: value for key, value in published_run(cfg).items() if key != PROTOCOL_KEY}
    backend.others = {i: LiveWorker(index=i, round=5, step=110, run=older) for i in (0, 1)}
    with pytest.raises(
        ConfigError, match=f"another version of diloco's protocol \\(an older one there, {PROTOCOL} here\\)"
    ):
        catch_up_with_run(Recovery(outer, backend, backend), backend, 0, 0, cfg=cfg, required=True, align_step=True)
    assert outer.loaded is None
    backend.others = {i: LiveWorker(index=i, round=5, step=110) for i in (0, 1)}  # not announced yet: not judged
    recovery = Recovery(outer, backend, backend)
    assert catch_up_with_run(recovery, backend, 0, 0, cfg=cfg, required=True, align_step=True)[1] == 5


def test_the_published_config_leaves_out_each_machines_own_keys_and_is_taken_back_whole(tmp_path):
    from omegaconf import OmegaConf

    from diloco.worker.joining import LOCAL_KEYS, config_from_run, published_run

    cfg = load_config(None, ["model.n_embd=64", "worker.threads=3", "comm.hivemind.port=4242", "comm.run_key=secret"])
    run = published_run(cfg)
    assert run["model.n_embd"] == 64  # the identity a newcomer's own config must match is still there
    for key in LOCAL_KEYS:
        *sections, name = key.split(".")
        section = run["config"]
        for part in sections:
            section = section[part]
        assert name not in section, key
    entries = {i: LiveWorker(index=i, round=1, step=5, run=run) for i in (0, 1)}
    taken = config_from_run(entries, "r")
    assert taken == run["config"] and taken["model"]["n_embd"] == 64 and "secret" not in str(taken)
    path = tmp_path / "run-config.yaml"  # what diloco join writes, then loads with the volunteer's overrides
    path.write_text(OmegaConf.to_yaml(taken))
    rebuilt = load_config(path, ["worker.threads=2"])
    assert (rebuilt.model.n_embd, rebuilt.worker.threads, rebuilt.comm.hivemind.port, rebuilt.comm.run_key) == (
        64,
        2,
        0,
        "",
    )


def test_a_config_that_does_not_match_its_digest_or_two_different_ones_are_refused_in_one_line():
    from diloco.worker.joining import JoinError, config_from_run, published_run

    run = published_run(load_config(None, []))
    tampered = {**run, "config": {**run["config"], "seed": 7}}
    other = published_run(load_config(None, ["seed=7"]))
    with pytest.raises(JoinError, match="no live worker of run 'r' publishes its config: join with the run's"):
        config_from_run({0: LiveWorker(index=0, round=1, step=5, run=tampered)}, "r")
    with pytest.raises(JoinError, match="publish 2 different configs"):
        config_from_run({i: LiveWorker(index=i, round=1, step=5, run=r) for i, r in enumerate((run, other))}, "r")
    with pytest.raises(JoinError, match="publishes its config"):
        config_from_run({0: LiveWorker(index=0, round=1, step=5)}, "r")
