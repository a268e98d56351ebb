"""Robust aggregation: the norm rule, how the simulator's averaging applies it, and a simulated run
in which one worker sends 100 x its pseudo-gradient."""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch

from diloco.comm.base import Averaging, CommBackend, Outcome, SyncResult
from diloco.comm.reduce import Contribution, average_payloads
from diloco.comm.robust import ScreeningRules, norm_of, screen
from diloco.compression import CompressionConfig, NoCompression, build_codec
from diloco.config import ConfigError, FaultConfig, load_config
from diloco.tools.launcher import simulate
from diloco.worker.faults import ForgedPayloadAveraging, with_bad_payloads, with_faults
from tests.conftest import TINY


def test_with_two_contributions_the_smaller_norm_is_the_reference():
    decision = screen({"honest": 1.0, "big": 100.0}, ScreeningRules(10, False))
    assert decision.median == 1.0
    assert list(decision.dropped) == ["big"] and decision.scales == {"honest": 1.0}
    assert "100" in decision.dropped["big"] and "median norm 1" in decision.dropped["big"]


def test_a_norm_at_the_ratio_is_kept_and_just_above_is_dropped():
    norms = {"a": 1.0, "b": 1.0, "c": 10.0, "d": 10.000001}
    decision = screen(norms, ScreeningRules(10, False))
    assert list(decision.dropped) == ["d"] and decision.scales == {"a": 1.0, "b": 1.0, "c": 1.0}


def test_ratio_zero_turns_the_rule_off_but_non_finite_norms_are_always_dropped():
    norms = {"a": 1.0, "b": 1e6, "c": math.nan, "d": math.inf}
    decision = screen(norms, ScreeningRules(0, False))
    assert sorted(decision.dropped) == ["c", "d"] and decision.scales == {"a": 1.0, "b": 1.0}
    assert decision.median == 1.0  # over the finite norms only
    on = screen(norms, ScreeningRules(10, False))
    assert sorted(on.dropped) == ["b", "c", "d"]


def test_clip_scales_the_norms_above_the_median_down_to_it():
    decision = screen({"a": 1.0, "b": 2.0, "c": 4.0, "d": 50.0}, ScreeningRules(10, True))
    assert decision.median == 2.0 and list(decision.dropped) == ["d"]
    assert decision.scales == {"a": 1.0, "b": 1.0, "c": 0.5}
    no_ratio = screen({"a": 1.0, "b": 2.0, "c": 4.0, "d": 50.0}, ScreeningRules(0, True))
    assert no_ratio.scales["d"] == pytest.approx(2.0 / 50.0) and not no_ratio.dropped


def test_a_zero_median_leaves_every_finite_contribution_in():
    # half the group sent nothing: no scale to judge the others by (dropping them all would stall training)
    decision = screen({"a": 0.0, "b": 0.0, "c": 5.0}, ScreeningRules(10, True))
    assert not decision.dropped and decision.scales == {"a": 1.0, "b": 1.0, "c": 1.0}


def test_a_contribution_far_below_what_its_samples_warrant_is_dropped_but_a_slower_worker_is_kept():
    # per sample: honest 1.0 / 100 each, the free rider 0 and faint noise 0.003 / 100 with the same claim,
    # the slower worker 0.4 / 20 (fewer samples, smaller norm, but more a sample); 0.02 / 100 is kept: a
    # newcomer whose error feedback holds nothing yet sends less than the others, not 100 x less
    norms = {"a": 1.0, "b": 1.1, "c": 0.9, "slow": 0.4, "zeros": 0.0, "faint": 0.003, "newcomer": 0.02}
    weights = {"a": 100, "b": 100, "c": 100, "slow": 20, "zeros": 100, "faint": 100, "newcomer": 100}
    decision = screen(norms, ScreeningRules(10, False), weights)
    assert sorted(decision.dropped) == ["faint", "zeros"], decision.dropped
    assert "less than 1/100 of the median norm 0.4 and 1/10 of what its samples warrant" in decision.dropped["zeros"]
    for order in itertools.permutations(norms, 3):  # the same decision whatever the order of arrival
        shuffled = {k: norms[k] for k in (*order, *(k for k in norms if k not in order))}
        assert screen(shuffled, ScreeningRules(10, False), weights).dropped.keys() == decision.dropped.keys()
    assert not screen(norms, ScreeningRules(10, False)).dropped  # the rule needs the weights
    assert "zeros" not in screen(norms, ScreeningRules(0, False), weights).dropped  # ratio 0: off
    pair = screen({"a": 1.0, "zeros": 0.0}, ScreeningRules(10, False), {"a": 1, "zeros": 1})
    assert not pair.dropped  # a group of two: its median is the zero
    # a site of 16 ranks (their mean: an honest norm, 16 x the samples) is below per sample, not in norm: kept
    site = screen({"a": 1.0, "b": 1.1, "c": 0.9, "site": 0.8}, ScreeningRules(10, False), {**weights, "site": 1600})
    assert not site.dropped, site.dropped
    # a claim of 1,000 x the samples counts for 4 x the median: an honest norm is then 1/4 a sample, kept
    claimed = screen(
        {"a": 1.0, "b": 1.0, "c": 1.0, "big": 1.0}, ScreeningRules(10, False, 4), {"a": 1, "b": 1, "c": 1, "big": 1000}
    )
    assert not claimed.dropped and claimed.weight(1000) == 4


def test_the_decision_depends_on_the_norms_alone_not_their_order():
    norms = {"a": 3.0, "b": 0.5, "c": 40.0, "d": 2.0, "e": math.nan}
    decisions = [screen(dict(order), ScreeningRules(10, True)) for order in itertools.permutations(norms.items())]
    assert all(d.dropped == decisions[0].dropped and d.scales == decisions[0].scales for d in decisions)
    assert sorted(decisions[0].dropped) == ["c", "e"]


def test_norm_of_spans_every_tensor_and_does_not_overflow():
    assert norm_of([torch.tensor([3.0]), torch.tensor([4.0])]) == pytest.approx(5.0)
    assert norm_of([torch.full((4,), 3e38)]) == pytest.approx(6e38)
    assert math.isnan(norm_of([torch.tensor([1.0, math.nan])]))


def _contribution(name: str, value: float, codec=None) -> Contribution:
    codec = codec or NoCompression()
    return Contribution(name, [codec.compress(torch.full((4,), value)), codec.compress(torch.full((2,), value))], 1.0)


def test_average_payloads_drops_a_blown_up_contribution_and_logs_who_sent_it(caplog):
    contributions = [_contribution("worker 0", 1.0), _contribution("worker 1", 3.0), _contribution("worker 2", 300.0)]
    with caplog.at_level(logging.WARNING, logger="diloco.comm.base"):
        means, used = average_payloads(NoCompression(), contributions, [4, 2], round_index=7, rules=ScreeningRules(10))
    assert [c.worker for c in used] == ["worker 0", "worker 1"]
    torch.testing.assert_close(means[0], torch.full((4,), 2.0))
    assert "round 8: dropped the contribution of worker 2: its norm 734.8 is more than 10 x the median" in caplog.text
    # off: the poisoned mean
    means, used = average_payloads(NoCompression(), contributions, [4, 2], round_index=7, rules=ScreeningRules(0))
    assert len(used) == 3 and means[0][0].item() == pytest.approx(304 / 3)


def test_average_payloads_clips_to_the_median_norm_of_the_decoded_contributions():
    codec = build_codec(CompressionConfig(name="int8"))
    contributions = [_contribution(f"worker {i}", v, codec) for i, v in enumerate([1.0, 2.0, 4.0])]
    means, used = average_payloads(codec, contributions, [4, 2], round_index=0, rules=ScreeningRules(10, True))
    assert len(used) == 3
    torch.testing.assert_close(means[0], torch.full((4,), (1 + 2 + 2) / 3), atol=0.02, rtol=0)


def test_config_checks_the_ratio_and_accepts_the_scaled_fault():
    with pytest.raises(ConfigError, match="comm.max_norm_ratio=0.5 must be 0"):
        load_config(None, ["comm.max_norm_ratio=0.5"])
    with pytest.raises(ConfigError, match="comm.max_norm_ratio=1.0"):
        load_config(None, ["comm.max_norm_ratio=1"])
    cfg = load_config(None, ["comm.max_norm_ratio=0", "faults.bad_payload=scaled", "comm.clip_to_median=true"])
    assert cfg.comm.max_norm_ratio == 0 and cfg.comm.clip_to_median
    # scaled payloads are well-formed fp32: torch.distributed's plain all-reduce carries them too
    load_config(None, ["faults.bad_payload=scaled", "comm.backend=torchdist"])


class _Echo(Averaging):
    """Records what it was given; succeeds (leaving the tensors as they are: a mean of one) or fails."""

    def __init__(self, ok: bool):
        self.ok, self.seen = ok, []

    def all_reduce_mean(self, tensors, weight, *, round_index, deadline_s, fragment=0):
        self.seen = [t.clone() for t in tensors]
        return SyncResult(Outcome.AVERAGED if self.ok else Outcome.FAILED, 1, weight)


@pytest.mark.parametrize("ok", [True, False])
def test_the_scaled_fault_sends_scale_times_the_tensors_and_a_failed_round_leaves_them_unscaled(ok):
    cfg = FaultConfig(worker=1, bad_payload="scaled", payload_scale=100.0)
    assert isinstance(with_faults(CommBackend(_Echo(ok)), cfg, 1).averaging, ForgedPayloadAveraging)
    assert isinstance(with_faults(CommBackend(_Echo(ok)), cfg, 0).averaging, _Echo)  # another worker: no fault
    assert with_bad_payloads(NoCompression(), cfg, 1).__class__ is NoCompression  # the payloads are well-formed
    inner = _Echo(ok)
    tensors = [torch.ones(3)]
    with_faults(CommBackend(inner), cfg, 1).averaging.all_reduce_mean(tensors, 1.0, round_index=0, deadline_s=1)
    torch.testing.assert_close(inner.seen[0], torch.full((3,), 100.0))
    torch.testing.assert_close(tensors[0], torch.full((3,), 100.0 if ok else 1.0))


def _sent(cfg: FaultConfig, rounds: list[list[torch.Tensor]], worker: int = 1) -> list[list[torch.Tensor]]:
    """What a worker with ``cfg``'s faults sends in each round, its contributions being ``rounds``."""
    inner = _Echo(True)
    averaging = with_faults(CommBackend(inner), cfg, worker).averaging
    sent = []
    for round_index, tensors in enumerate(rounds):
        averaging.all_reduce_mean([t.clone() for t in tensors], 1.0, round_index=round_index, deadline_s=1)
        sent.append(inner.seen)
    return sent


def test_the_noise_fault_sends_gaussian_noise_of_the_contributions_norm_new_each_round():
    rounds = [[torch.full((300,), 2.0), torch.ones(2, 50)] for _ in range(2)]
    first, second = _sent(FaultConfig(worker=1, bad_payload="noise"), rounds)
    norm = torch.cat([t.reshape(-1) for t in rounds[0]]).norm()
    for sent in (first, second):
        flat = torch.cat([t.reshape(-1) for t in sent])
        torch.testing.assert_close(flat.norm(), norm)
        assert (
            abs(float(torch.nn.functional.cosine_similarity(flat, torch.cat([t.reshape(-1) for t in rounds[0]]), 0)))
            < 0.2
        )
    assert not torch.equal(first[0], second[0])  # new noise each round
    assert [t.shape for t in first] == [t.shape for t in rounds[0]]


def test_the_replay_fault_sends_the_contribution_of_the_round_before():
    rounds = [[torch.full((3,), float(r))] for r in (1, 2, 3)]
    sent = _sent(FaultConfig(worker=1, bad_payload="replay"), rounds)
    assert [float(s[0][0]) for s in sent] == [1.0, 1.0, 2.0]  # its real one first, then each a round late


def test_faults_count_makes_that_many_workers_from_faults_worker_attack_alike():
    cfg = FaultConfig(worker=6, count=2, bad_payload="scaled", payload_scale=-9.0)
    attacking = [
        isinstance(with_faults(CommBackend(_Echo(True)), cfg, w).averaging, ForgedPayloadAveraging) for w in range(8)
    ]
    assert attacking == [False] * 6 + [True, True]
    with pytest.raises(ConfigError, match="faults.count=0 must be at least 1"):
        load_config(None, ["faults.count=0"])
    with pytest.raises(ConfigError, match="noise, replay"):
        load_config(None, ["faults.bad_payload=bogus"])


def _simulated_loss(tmp_path, name: str, *overrides: str) -> tuple[dict, float]:
    cfg = load_config(
        None,
        [
            *TINY,
            "comm.backend=simulator",
            "inner.steps=10",
            "outer.sync_every=5",
            "checkpoint.every_rounds=0",
            f"run.dir={tmp_path / name}",
            *overrides,
        ],
    )
    summary = simulate(cfg, workers=4)
    assert summary["failed_workers"] == [], summary
    return summary, summary["final_val_loss"]


def test_a_simulated_worker_with_scaled_payloads_is_dropped_and_the_run_learns_as_without_it(tmp_path, caplog):
    _, clean = _simulated_loss(tmp_path, "clean")
    with caplog.at_level(logging.WARNING, logger="diloco.comm.base"):
        summary, robust = _simulated_loss(tmp_path, "robust", "faults.worker=2", "faults.bad_payload=scaled")
    drops = [r.getMessage() for r in caplog.records if "dropped the contribution of worker 2" in r.getMessage()]
    assert len(drops) == 2 and all("x the median norm" in d for d in drops), caplog.text  # both rounds
    assert not any("worker 0" in r.getMessage() or "worker 1" in r.getMessage() for r in caplog.records)
    assert summary["params_agree"]  # the dropped worker took the others' mean too
    assert robust == pytest.approx(clean, rel=0.03)
    # the same fault with the rule off wrecks the run: the check above is not vacuous
    _, poisoned = _simulated_loss(
        tmp_path, "off", "faults.worker=2", "faults.bad_payload=scaled", "comm.max_norm_ratio=0"
    )
    assert poisoned > clean * 1.2, (poisoned, clean)


def test_norm_of_a_long_vector_is_its_float64_norm_to_a_millionth():
    values = torch.randn(1_000_003, generator=torch.Generator().manual_seed(0))
    exact = float(torch.linalg.vector_norm(values, dtype=torch.float64))
    assert norm_of([values[:10], values[10:]]) == pytest.approx(exact, rel=1e-6)


def test_a_weight_claim_above_the_bound_counts_for_the_bound_and_the_mean_follows():
    weights = {"a": 12.0, "b": 12.0, "c": 6.0, "d": 12_000.0}
    decision = screen(dict.fromkeys(weights, 1.0), ScreeningRules(max_weight_ratio=4), weights)
    assert decision.max_weight == 48.0 and decision.weight(12_000.0) == 48.0 and decision.weight(6.0) == 6.0
    assert screen(dict.fromkeys(weights, 1.0), ScreeningRules(), weights).weight(12_000.0) == 12_000.0  # off
    contributions = [_contribution(f"worker {i}", v) for i, v in enumerate([1.0, 2.0, 3.0, 4.0])]
    contributions[3] = Contribution("worker 3", contributions[3].payloads, 1000.0)
    means, used = average_payloads(
        NoCompression(), contributions, [4, 2], round_index=0, rules=ScreeningRules(0, False, 4)
    )
    assert [c.weight for c in used] == [1.0, 1.0, 1.0, 4.0]
    torch.testing.assert_close(means[0], torch.full((4,), (1 + 2 + 3 + 4 * 4) / 7))


def test_a_codec_that_gathers_is_screened_by_direction_on_its_sparse_values_too():
    # top-k as SparseLoCo runs it: each worker sends its own largest values, and the mean is gathered
    codec = build_codec(CompressionConfig(name="topk", topk_mean="senders"))
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(4096, generator=generator)
    vectors = [common + 0.5 * torch.randn(4096, generator=generator) for _ in range(3)]
    vectors.append(-9 * vectors[0])
    contributions = [Contribution(f"worker {i}", [codec.compress(v)], 1.0) for i, v in enumerate(vectors)]
    rules = ScreeningRules(min_cosine=0.0)
    means, used = average_payloads(codec, contributions, [4096], round_index=0, rules=rules)
    assert [c.worker for c in used] == ["worker 0", "worker 1", "worker 2"]
    honest, _ = average_payloads(codec, contributions[:3], [4096], round_index=0)
    torch.testing.assert_close(means[0], honest[0])
    _, all_used = average_payloads(codec, contributions[:3], [4096], round_index=0, rules=rules)
    assert len(all_used) == 3  # no honest one left out


def test_a_simulated_worker_sending_minus_nine_times_its_pseudo_gradient_is_dropped_by_direction(tmp_path, caplog):
    _, clean = _simulated_loss(tmp_path, "clean")
    attack = ["faults.worker=2", "faults.bad_payload=scaled", "faults.payload_scale=-9"]
    with caplog.at_level(logging.WARNING, logger="diloco.comm.reduce"):
        summary, screened = _simulated_loss(tmp_path, "screened", *attack, "comm.min_cosine=0")
    drops = [r.getMessage() for r in caplog.records if "dropped the contribution of worker 2" in r.getMessage()]
    assert len(drops) == 2 and all("does not point the others' way" in d for d in drops), caplog.text  # both rounds
    assert not any("worker 0" in r.getMessage() or "worker 1" in r.getMessage() for r in caplog.records)
    assert summary["params_agree"]
    _, unscreened = _simulated_loss(tmp_path, "unscreened", *attack, "comm.min_cosine=-1")
    assert abs(screened - clean) < abs(unscreened - clean), (clean, screened, unscreened)


def test_config_checks_the_screening_settings():
    with pytest.raises(ConfigError, match="comm.max_weight_ratio=0.5 must be 0"):
        load_config(None, ["comm.max_weight_ratio=0.5"])
    with pytest.raises(ConfigError, match=r"comm.min_cosine=1.0 must be in \[-1, 1\)"):
        load_config(None, ["comm.min_cosine=1"])
    with pytest.raises(
        ConfigError, match="comm.hivemind.data_plane=gloo sums vectors nobody sees: set comm.trust=trusted"
    ):
        load_config(None, ["comm.min_cosine=0", "comm.hivemind.data_plane=gloo"])
    with pytest.raises(ConfigError, match="comm.backend=torchdist sums them in one all-reduce"):
        load_config(None, ["comm.min_cosine=0", "comm.backend=torchdist"])
    with pytest.raises(ConfigError, match="outer.sync_every=0 .the data-parallel baseline. averages"):
        load_config(None, ["comm.min_cosine=0", "outer.sync_every=0"])
    with pytest.raises(ConfigError, match="faults.weight_scale=0.0 must be a positive number"):
        load_config(None, ["faults.weight_scale=0"])
