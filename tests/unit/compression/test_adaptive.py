"""The codec chosen per round (compression.name=adaptive): how peers agree, how a worker's
preference follows its link, and error feedback settled with the round's codec."""

from __future__ import annotations

import pytest
import torch

from diloco.comm.link_meter import LinkMeter, round_bytes
from diloco.compression import CompressionConfig, ErrorFeedback, build_codec
from diloco.errors import ConfigError

NUMEL = 1 << 20


ALL = ["none", "fp16", "int8", "int4", "topk"]


def _adaptive(**overrides):
    return build_codec(CompressionConfig(name="adaptive", **{"adaptive_codecs": ALL, **overrides}))


def test_a_group_takes_the_most_lossy_preference_its_peers_declared():
    assert [c.name for c in build_codec(CompressionConfig(name="adaptive")).candidates] == [
        "none",
        "fp16",
        "int8",
        "int4",
    ]
    codec = _adaptive()

    def declared(*preferences):
        return [{"weight": 1.0, "codec": p} for p in preferences]

    assert codec.agreed(declared(0, 2, 1)).name == "int8"  # the slowest link decides
    # what is not a candidate's index, or not a peer's dict, is ignored
    assert codec.agreed([*declared(0, None, "x", 99, -1, True), "garbage", None, {}]).name == "none"
    assert codec.agreed([]).label == "topk-64"  # nobody said: the most lossy, which fits any link
    # every peer reads the same declarations, in whatever order: the same codec
    orders = (declared(3, 1, 0), declared(0, 3, 1), declared(1, 0, 3))
    assert {codec.agreed(order).name for order in orders} == {"int4"}
    assert codec.align % 4096 == 0 and codec.align % 64 == 0  # hivemind's parts suit every candidate


def test_topk_among_the_candidates_is_a_ladder_of_k_from_eight_times_topk_k_to_it():
    codec = _adaptive(topk_k=64, topk_chunk=4096, topk_mean="senders")
    assert [c.label for c in codec.candidates] == [
        "none", "fp16", "int8", "int4", "topk-512", "topk-256", "topk-128", "topk-64"
    ]  # fmt: skip
    assert {c.mean for c in codec.candidates[4:]} == {"senders"}
    assert [c.label for c in _adaptive(topk_k=300, topk_chunk=1024).candidates[4:]] == [
        "topk-1024",
        "topk-600",
        "topk-300",
    ]
    assert codec.named("topk-128") is codec.candidates[6]


def test_a_workers_preference_waits_for_a_measure_takes_what_fits_and_falls_when_the_link_slows():
    codec = _adaptive(comm_budget=0.1)
    meter = LinkMeter(codec)
    between_rounds_s = 10.0  # compute: a transfer may take 1 s
    assert meter.preferred(numel=NUMEL, peers=4, between_rounds_s=between_rounds_s) is None  # nothing measured
    # a fast link (400 MB/s): the small top-k round took a moment, far under its budget. The
    # throughput measured on it would allow fp32 already; the choice climbs one codec a round
    fast = 400e6
    chosen = []
    last = codec.candidates[4]
    for _ in range(5):
        moved = round_bytes(last, NUMEL, 4)
        meter.record(last, moved, moved / fast)
        index = meter.preferred(numel=NUMEL, peers=4, between_rounds_s=between_rounds_s)
        chosen.append(codec.candidates[index].name)
        last = codec.candidates[index]
    assert chosen == ["none", "none", "none", "none", "none"]  # the estimate allows fp32 at once
    # a link of 2 MB/s: fp32's round (about 12.6 MB) took 6 s; int4's (1.8 MB) fits in 1 s at that rate
    slow = 2e6
    moved = round_bytes(last, NUMEL, 4)
    meter.record(last, moved, moved / slow)
    index = meter.preferred(numel=NUMEL, peers=4, between_rounds_s=between_rounds_s)
    assert codec.candidates[index].name == "int4"
    int4_s, int8_s = (round_bytes(codec.candidates[i], NUMEL, 4) / slow for i in (3, 2))
    assert int4_s <= 1.0 < int8_s


def test_a_pessimistic_measure_still_lets_the_choice_climb_while_a_round_takes_under_half_its_budget():
    codec = _adaptive(comm_budget=0.1)
    meter = LinkMeter(codec)
    # a round of top-k that took 0.9 s for its few bytes (latency, not bandwidth): by that rate
    # int4 does not fit the 2 s allowed, but is predicted within twice it, and 0.9 s is under half
    topk, int4 = codec.candidates[4], codec.candidates[3]
    meter.record(topk, round_bytes(topk, NUMEL, 4), 0.9)
    assert 2.0 < round_bytes(int4, NUMEL, 4) / meter.throughput <= 4.0
    assert meter.preferred(numel=NUMEL, peers=4, between_rounds_s=20.0) == 3
    meter.record(codec.candidates[3], round_bytes(codec.candidates[3], NUMEL, 4), 1.5)  # over half: by the rate
    assert meter.preferred(numel=NUMEL, peers=4, between_rounds_s=20.0) == 3


def test_no_climb_to_a_codec_predicted_far_over_the_budget_nor_back_to_one_whose_round_failed():
    codec = _adaptive(comm_budget=0.1)
    meter = LinkMeter(codec)
    labels = [c.label for c in codec.candidates]
    topk, int4, fitting = codec.candidates[-1], codec.candidates[3], labels.index("topk-128")
    rate = 150e3  # bytes a second: of the top-k ladder, 128 values a chunk is the most that fits 2 s
    assert [round_bytes(c, NUMEL, 4) / rate <= 2.0 for c in codec.candidates[4:]] == [False, False, True, True]
    # top-k's round took under half the 2 s allowed, but int4's would take ~12 s: no climb to it
    meter.record(topk, round_bytes(topk, NUMEL, 4), round_bytes(topk, NUMEL, 4) / rate)
    assert meter.last_transfer_s < 1.0 and round_bytes(int4, NUMEL, 4) / rate > 4.0
    assert meter.preferred(numel=NUMEL, peers=4, between_rounds_s=20.0) == fitting
    # an int4 round that failed after 20 s, a third of it through: int4 is not tried again; by
    # that (low) rate nothing fits, and the choice falls to the most lossy
    meter.record(int4, round_bytes(int4, NUMEL, 4) // 3, 20.0)
    assert meter.preferred(numel=NUMEL, peers=4, between_rounds_s=20.0) == len(codec.candidates) - 1


def test_error_feedback_settled_with_the_rounds_codec_is_the_fixed_codecs_bit_for_bit():
    torch.manual_seed(0)
    rounds = [[torch.randn(5000), torch.randn(300)] for _ in range(3)]
    for name, label in (("int8", "int8"), ("topk", "topk-64"), ("none", "none")):
        fixed = ErrorFeedback(build_codec(CompressionConfig(name=name)), enabled=True, decay=0.95)
        chosen = ErrorFeedback(_adaptive(), enabled=True, decay=0.95)
        for tensors in rounds:
            sent_fixed = fixed.apply(tensors)
            sent_chosen = chosen.apply(tensors)
            chosen.settle(label)
            for a, b in zip(sent_fixed, sent_chosen):
                assert torch.equal(a, b)
            if fixed.residuals is not None:
                for a, b in zip(fixed.residuals, chosen.residuals):
                    assert torch.equal(a, b)
            else:
                assert all(not r.any() for r in chosen.residuals)  # fp32 sends everything


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"adaptive_codecs": []}, "adaptive_codecs is empty"),
        ({"adaptive_codecs": ["none", "gzip"]}, "'gzip' is not one of"),
        ({"adaptive_codecs": ["int8", "int8"]}, "names a codec twice"),
        ({"adaptive_codecs": ["topk", "none"]}, "must run from least to most lossy"),
        ({"comm_budget": 0.0}, "comm_budget=0.0 must be above 0"),
    ],
)
def test_bad_adaptive_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _adaptive(**overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["comm.backend=simulator"], "compression.name=adaptive needs comm.backend=hivemind, not simulator"),
        (["outer.overlap=streaming"], "runs blocking rounds: outer.overlap=none, not streaming"),
        (["outer.optimizer=sparseloco"], "outer.optimizer=sparseloco takes its momentum"),
        (["faults.bad_payload=nan"], "faults.bad_payload breaks a fixed codec's payloads"),
    ],
)
def test_adaptive_compression_is_refused_where_its_peers_cannot_agree_per_round(overrides, message):
    from diloco.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["compression.name=adaptive", "comm.backend=hivemind", *overrides])
