"""Overlapped outer steps (outer.overlap): the schedule, what each applies, and their agreement with
the blocking round where they must agree."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diloco.comm.base import Averaging, Membership, Outcome, PeerState, StateExchange, StateRank, SyncResult
from diloco.comm.bounds import round_limit_s
from diloco.config import ConfigError, load_config
from diloco.core.outer import OuterConfig, OuterStep
from diloco.core.overlap import OverlappedOuter, split_fragments
from diloco.core.recovery import Recovery, Standing
from diloco.tools.launcher import simulate
from tests.conftest import TINY


class ScriptedAverages(Averaging):
    """An averaging whose n-th average (per fragment) is the value ``n + 1`` everywhere; records calls."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []  # (fragment, round_index)

    def all_reduce_mean(self, tensors, weight, *, round_index, deadline_s, fragment=0):
        self.calls.append((fragment, round_index))
        for tensor in tensors:
            tensor.fill_(round_index + 1.0)
        return SyncResult(Outcome.AVERAGED, 2, 2 * weight)


def _outer(values: list[float], **cfg) -> tuple[OverlappedOuter, OuterStep, ScriptedAverages, list]:
    local = [torch.nn.Parameter(torch.full((3,), v)) for v in values]
    outer_cfg = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0, **cfg)
    outer = OuterStep(local, outer_cfg)
    backend = ScriptedAverages()
    overlapped = OverlappedOuter(outer, backend, Recovery(outer), outer_cfg, deadline_s=1, expected_peers=2)
    return overlapped, outer, backend, local


def _run(overlapped: OverlappedOuter, steps: int, local: list, on_step=None) -> None:
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in local:
                p.sub_(0.5)  # "training"
        overlapped.after_inner_step(step, samples_per_step=1, compute_s=0.0, final=step == steps)
        if on_step:
            on_step(step)


def test_delayed_applies_exactly_the_previous_rounds_average():
    overlapped, outer, backend, local = _outer([10.0], overlap="delayed", sync_every=4)
    seen, local_seen = {}, {}

    def look(step):
        seen[step], local_seen[step] = outer.global_params[0][0].item(), local[0][0].item()

    _run(overlapped, 12, local, look)
    # step 4: round 0 starts, nothing applied yet; step 8: round 0's average (1) applied; step 12 (the
    # last): round 1's average (2) applied, then round 2 starts and is applied at once (3)
    assert seen[3] == 10.0 and seen[4] == 10.0
    assert seen[8] == 10.0 - 1
    # the local params are never thrown back: they keep this worker's own progress of the round that
    # just ended (4 steps of 0.5) on top of the new global params
    assert local_seen[4] == 10.0 - 2 and local_seen[8] == 9.0 - 2
    assert seen[12] == 10.0 - 1 - 2 - 3
    assert backend.calls == [(0, 0), (0, 1), (0, 2)]
    assert local[0][0].item() == outer.global_params[0][0].item()  # the run ends on the global params


def test_streaming_syncs_fragments_staggered_and_applies_each_tau_steps_later():
    overlapped, outer, backend, local = _outer([10.0, 20.0], overlap="streaming", sync_every=4, fragments=2,
                                               delay_steps=1)  # fmt: skip
    applied_at: dict[int, list[float]] = {}
    _run(overlapped, 8, local, lambda step: applied_at.setdefault(step, [g[0].item() for g in outer.global_params]))
    # fragment 0 syncs at steps 2, 6; fragment 1 at steps 4, 8 (8 is the last: both sync, all applied)
    assert backend.calls == [(0, 0), (1, 0), (0, 1), (0, 2), (1, 1)]
    assert applied_at[2] == [10.0, 20.0]  # started, not applied yet
    assert applied_at[3] == [9.0, 20.0]  # fragment 0's first average, one step later
    assert applied_at[5] == [9.0, 19.0]
    assert applied_at[7] == [7.0, 19.0]
    assert applied_at[8] == [7.0 - 3.0, 19.0 - 2.0]


class ScriptedWithStates(ScriptedAverages, StateExchange):
    """``ScriptedAverages`` whose averages listed in ``lost`` ((fragment, round) pairs) fail for this
    worker (hivemind lost part of them); a peer whose did not offers ``peer_state`` at the run's
    end. Records what is published and asked for."""

    def __init__(self, lost: set[tuple[int, int]], peer_state: dict | None = None):
        super().__init__()
        self.lost, self.peer_state, self.published, self.asked = lost, peer_state, [], []

    def all_reduce_mean(self, tensors, weight, *, round_index, deadline_s, fragment=0):
        result = super().all_reduce_mean(tensors, weight, round_index=round_index, deadline_s=deadline_s)
        if (fragment, round_index) in self.lost:
            return SyncResult(Outcome.FAILED, 1, weight, error="64 values were not averaged")
        return result

    def publish_state(self, round_index, rank, state):
        self.published.append((round_index, rank.peers))

    def fetch_state(self, round_index, *, better_than, timeout_s, newer=False, check=None):
        self.asked.append((round_index, better_than.peers, newer))
        return None if self.peer_state is None else PeerState(round_index, StateRank(2), self.peer_state)


def _use(overlapped: OverlappedOuter, transport: ScriptedWithStates) -> ScriptedWithStates:
    """``overlapped`` averaging over ``transport``, and its recovery using its states."""
    overlapped.averaging = transport
    overlapped.recovery = Recovery(overlapped.outer, transport, Membership())
    return transport


class NeverAnswers(ScriptedWithStates):
    """A transport whose averages of fragment 1 never finish (a hivemind round stuck past every timeout
    of its own); the rest as ``ScriptedWithStates``. It averages in the background, as hivemind does."""

    averages_in_background = True

    def __init__(self):
        super().__init__(set())
        self.release = threading.Event()  # set at the test's end, so that no thread outlives it

    def all_reduce_mean(self, tensors, weight, *, round_index, deadline_s, fragment=0):
        if fragment == 1:
            self.release.wait()
            return SyncResult(Outcome.FAILED, 1, weight, error="released")
        return super().all_reduce_mean(tensors, weight, round_index=round_index, deadline_s=deadline_s)


@pytest.mark.timeout(60)
def test_an_overlapped_average_that_never_ends_fails_at_its_bound_and_the_run_goes_on(caplog):
    # the hang of a streaming worker: an average of fragment 1 that never came back left the trainer
    # waiting for it forever; it now gives up after round_limit_s(deadline) and applies its own
    overlapped, outer, _, local = _outer([10.0, 20.0], overlap="streaming", sync_every=4, fragments=2,
                                         delay_steps=1)  # fmt: skip
    overlapped.deadline_s, overlapped.wait_limit_s = 0.2, round_limit_s(0.2)
    backend = _use(overlapped, NeverAnswers())
    try:
        started = time.monotonic()
        applied = []
        for step in range(1, 9):
            with torch.no_grad():
                for p in local:
                    p.sub_(0.5)
            applied += overlapped.after_inner_step(step, samples_per_step=1, compute_s=0.0, final=step == 8)
        waited = time.monotonic() - started
    finally:
        backend.release.set()
    stuck = [a for a in applied if not a.result.ok]
    assert len(stuck) == 2 and all("no result within 1 s: the average was abandoned" in a.result.error for a in stuck)
    assert waited < 2 * 2 * round_limit_s(0.2) + 5  # two waits of fragment 1, each at its bound
    assert "fragment 1: averaging failed (no result within 1 s" in caplog.text
    # its own progress applied each time: 4 steps to step 4, then 3 from the restart at step 5 to step 8
    assert outer.global_params[1][0].item() == 20.0 - 4 * 0.5 - 3 * 0.5


def _streaming_that_loses_an_average(peer_state_of=None, lost=frozenset({(1, 0)})):
    overlapped, outer, _, local = _outer([10.0, 20.0], overlap="streaming", sync_every=4, fragments=2,
                                         delay_steps=1)  # fmt: skip
    backend = _use(overlapped, ScriptedWithStates(set(lost), peer_state_of(outer) if peer_state_of else None))
    applied = []
    for step in range(1, 9):
        with torch.no_grad():
            for p in local:
                p.sub_(0.5)
        applied.append(overlapped.after_inner_step(step, samples_per_step=1, compute_s=0.0, final=step == 8))
    return overlapped, outer, backend, local, applied


def test_streaming_takes_a_peers_state_at_the_end_after_an_average_failed_for_it():
    # with several fragments a peer's state mid-run would mix fragments at other points of their
    # schedules, so the worker whose average failed takes one when every worker has applied the same
    # averages: at the run's end (5 syncs started in all), ranked below every peer
    def peers_state(outer):
        return {
            "global_params": [torch.full((3,), 4.0), torch.full((3,), 17.0)],
            "optimizer": outer.optimizer.state_dict(),
        }

    overlapped, outer, backend, local, applied = _streaming_that_loses_an_average(peers_state)
    assert [a.recovered for a in applied[4]] == [False]  # fragment 1's failed average (step 5): kept going
    assert overlapped.recovery.standing is Standing.SYNCED and all(a.recovered for a in applied[-1])
    assert backend.asked == [(5, 1, True)]  # its other averages held the others' mean: ranked as alone
    assert backend.published[0] == (3, 0)  # before the last syncs: an older state, so peers wait for us
    assert [g[0].item() for g in outer.global_params] == [4.0, 17.0]
    assert [p[0].item() for p in local] == [4.0, 17.0]


def test_a_streaming_worker_none_of_whose_averages_held_ranks_below_one_that_averaged_some():
    # a sync that failed for every worker leaves them all apart; the one whose every contribution
    # was dropped (peers 0) must not win that run's end over those that averaged the others (peers 1)
    every_sync = {(0, 0), (1, 0), (0, 1), (0, 2), (1, 1)}
    *_, backend, _, _ = _streaming_that_loses_an_average(lost=every_sync)
    assert backend.asked == [(5, 0, True)]


def test_streaming_without_a_failed_average_offers_its_state_and_takes_none():
    overlapped, outer, backend, local = _outer([10.0, 20.0], overlap="streaming", sync_every=4, fragments=2,
                                               delay_steps=1)  # fmt: skip
    quiet = _use(overlapped, ScriptedWithStates(lost=set()))
    _run(overlapped, 8, local)
    assert quiet.asked == [] and quiet.published == [(3, 0), (5, 2)]
    assert [g[0].item() for g in outer.global_params] == [7.0 - 3.0, 19.0 - 2.0]


def test_streaming_that_finds_no_better_state_at_the_end_stays_marked_drifted():
    overlapped, outer, backend, local, applied = _streaming_that_loses_an_average()
    assert overlapped.recovery.standing is Standing.UNSYNCED and not any(a.recovered for a in applied[-1])
    assert overlapped.state_dict()["drifted"]


def test_streaming_restarts_local_params_mixed_with_alpha():
    overlapped, outer, _, local = _outer([10.0], overlap="streaming", sync_every=4, fragments=1, delay_steps=2,
                                         mix=0.5)  # fmt: skip
    _run(overlapped, 6, local)
    # sync at step 4, applied at step 6 (local 7): global 10 - 1 = 9, local (9 + 7) / 2 = 8; then the
    # last step's sync: global 9 - 2 = 7, local (7 + 8) / 2
    assert outer.global_params[0][0].item() == 7.0
    assert local[0][0].item() == 7.5


def test_split_fragments_balances_values_and_keeps_every_tensor_once():
    params = [torch.zeros(n) for n in (100, 10, 10, 100, 50, 50)]
    fragments = split_fragments(params, 2)
    assert sorted(i for f in fragments for i in f) == list(range(6))
    sizes = [sum(params[i].numel() for i in f) for f in fragments]
    assert abs(sizes[0] - sizes[1]) <= 100
    with pytest.raises(ValueError, match="too few parameter tensors"):
        split_fragments(params[:1], 2)


def _simulate(tmp_path, name, *overrides, workers=2):
    cfg = load_config(
        None,
        [*TINY, "comm.backend=simulator", "inner.steps=24", "outer.sync_every=6", "checkpoint.every_rounds=0",
         f"run.dir={tmp_path / name}", f"comm.run_id={name.replace('-', '_')}", *overrides],
    )  # fmt: skip
    return simulate(cfg, workers=workers)


@pytest.mark.timeout(240)
def test_streaming_with_one_fragment_and_no_delay_equals_blocking_diloco(tmp_path):
    blocking = _simulate(tmp_path, "blocking")
    streaming = _simulate(tmp_path, "streaming", "outer.overlap=streaming", "outer.fragments=1", "outer.delay_steps=0")
    assert blocking["params_agree"] and streaming["params_agree"]
    assert streaming["param_sha256"] == blocking["param_sha256"]
    assert streaming["final_val_loss"] == blocking["final_val_loss"]


@pytest.mark.timeout(240)
def test_eager_with_one_worker_is_blocking_diloco(tmp_path):
    # alone, a worker's stale share is the whole average: eager replaces it by the fresh one, every round
    blocking = _simulate(tmp_path, "blocking1", workers=1)
    eager = _simulate(tmp_path, "eager1", "outer.overlap=delayed", "outer.eager=true", workers=1)
    assert eager["final_val_loss"] == pytest.approx(blocking["final_val_loss"], rel=1e-4)


@pytest.mark.timeout(240)
def test_overlap_hides_the_modelled_communication_behind_compute(tmp_path):
    slow = ["comm.bandwidth_mbps=50"]
    blocking = _simulate(tmp_path, "slow-blocking", *slow)
    delayed = _simulate(tmp_path, "slow-delayed", *slow, "outer.overlap=delayed")
    streaming = _simulate(tmp_path, "slow-streaming", *slow, "outer.overlap=streaming", "outer.fragments=2",
                          "outer.delay_steps=3")  # fmt: skip
    assert blocking["comm_wait_s"] > 0
    assert delayed["comm_wait_s"] < blocking["comm_wait_s"]
    assert streaming["comm_wait_s"] < blocking["comm_wait_s"]
    assert delayed["params_agree"] and streaming["params_agree"]
    assert delayed["bytes_sent"] == blocking["bytes_sent"]
    # a fragment at a time on the wire; the last step syncs every fragment once more
    assert streaming["peak_sync_bytes"] < 0.6 * blocking["peak_sync_bytes"]
    assert blocking["bytes_sent"] < streaming["bytes_sent"] < 1.2 * blocking["bytes_sent"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["outer.overlap=sometimes"], "outer.overlap='sometimes' is not one of"),
        (["outer.overlap=delayed", "outer.sync_every=0"], "needs DiLoCo rounds"),
        (["outer.overlap=streaming", "outer.fragments=3", "outer.sync_every=50"], "multiple of outer.fragments"),
        (["outer.overlap=streaming", "outer.fragments=2", "outer.delay_steps=30"], "must be in [0, 25]"),
        (["outer.overlap=streaming", "outer.delay_steps=50"], "must be in [0, 49]"),
        (["outer.eager=true"], "outer.overlap=delayed only"),
        (["outer.overlap=streaming", "outer.mix=1.0"], "outer.mix=1.0 must be in [0, 1)"),
        (["outer.overlap=delayed", "outer.mix=0.5"], "outer.overlap=streaming only"),
    ],
)
def test_bad_overlap_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)
