"""Codecs: round-trip error bounds, exact payload sizes, rejection of bad payloads, error feedback."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.comm.reduce import Contribution, average_payloads
from diloco.compression import CODECS, CompressionConfig, ErrorFeedback, PayloadError, build_codec
from diloco.compression.codec import HEADER_BYTES

SMALL = CompressionConfig(block_size=8, topk_k=4, topk_chunk=32)  # small blocks: many of them in small tensors


def codec_of(name: str, cfg: CompressionConfig = SMALL):
    return build_codec(CompressionConfig(**{**cfg.__dict__, "name": name}))


def error_bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """The largest error each codec may make on ``x`` (elementwise, per block)."""
    if name == "none":
        return torch.zeros_like(x)
    if name == "fp16":
        return x.abs() * 2**-11 + 6e-8
    if name == "topk":  # a value is either sent (4 levels) or dropped: never more than its chunk's max
        chunks = torch.nn.functional.pad(x.abs(), (0, -x.numel() % 32)).view(-1, 32).amax(1)
        return chunks.repeat_interleave(32)[: x.numel()] * 1.0001
    levels = {"int8": 127, "int4": 7}[name]
    blocks = torch.nn.functional.pad(x.abs(), (0, -x.numel() % 8)).view(-1, 8).amax(1)
    return (blocks / levels / 2).repeat_interleave(8)[: x.numel()] * 1.0001 + 1e-12


sizes = st.integers(min_value=0, max_value=300)


@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=25, deadline=None)
@given(numel=sizes, scale=st.floats(min_value=1e-6, max_value=1e3), seed=st.integers(0, 2**16))
def test_round_trip_error_is_bounded_and_payload_size_exact(name, numel, scale, seed):
    codec = codec_of(name)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
    payload = codec.compress(x)
    assert len(payload) == codec.payload_bytes(numel)
    restored = codec.decompress(payload, numel)
    assert restored.dtype == torch.float32 and restored.shape == (numel,)
    assert bool(((restored - x).abs() <= error_bound(name, x)).all())


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_any_float_dtype_and_shape_round_trips(name, dtype):
    codec = codec_of(name)
    x = torch.randn(3, 5, 7).to(dtype)
    restored = codec.roundtrip(x)
    assert restored.shape == x.shape and restored.dtype == torch.float32
    assert bool(((restored - x.float()).abs().view(-1) <= error_bound(name, x.float().view(-1))).all())


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
def test_aligned_slices_compress_to_the_same_values_as_the_whole(name):
    # transports may cut a tensor at multiples of codec.align: the pieces must decode as the whole does
    codec = codec_of(name)
    x = torch.randn(10 * codec.align + 3)
    whole = codec.roundtrip(x)
    cut = 4 * codec.align
    pieces = torch.cat([codec.roundtrip(x[:cut]), codec.roundtrip(x[cut:])])
    assert torch.equal(whole, pieces)


def test_compression_ratios():
    x = torch.randn(1 << 20)
    ratio = {name: 4 * x.numel() / len(codec_of(name, CompressionConfig()).compress(x)) for name in CODECS}
    assert ratio["none"] == pytest.approx(1.0, rel=1e-4)
    assert ratio["fp16"] == pytest.approx(2.0, rel=1e-4)
    assert ratio["int8"] == pytest.approx(4 / (1 + 4 / 64), rel=1e-3)  # a byte a value, a fp32 scale per 64
    assert ratio["int4"] == pytest.approx(4 / (0.5 + 4 / 64), rel=1e-3)
    # 64 of 4096 kept: Elias-Fano positions (6 low bits each, a 128-bit upper bitmap: 512 bits),
    # 2-bit values, one fp32 scale a chunk: 84 bytes for 16 KiB
    assert ratio["topk"] == pytest.approx(16384 / 84, rel=1e-3)


@pytest.mark.parametrize("chunk", [4096, 8192, 65536])
def test_topk_keeps_every_position_of_a_chunk_exactly(chunk):
    # the first and last positions of each chunk, and neighbours, survive the position code
    codec = codec_of("topk", CompressionConfig(topk_k=3, topk_chunk=chunk))
    x = torch.zeros(2 * chunk + 7)
    x[[0, 1, chunk - 1, chunk, 2 * chunk - 2, 2 * chunk - 1, 2 * chunk + 6]] = torch.tensor([1.0, 1, -1, 1, 1, -1, 1])
    assert torch.equal(codec.roundtrip(x), x)
    low = (chunk // 3).bit_length() - 1  # Elias-Fano: low bits a position, and an upper bitmap a chunk
    tail_bits = 2 + 1 + (6 >> 2) + 1  # the tail of 7 keeps 1
    position_bits = 2 * (3 * low + 3 + ((chunk - 1) >> low) + 1) + tail_bits  # 3 kept in each full chunk
    assert codec.body_bytes(x.numel()) == 4 * 3 + -(-position_bits // 8) + 2


@pytest.mark.parametrize(("k", "chunk"), [(64, 4096), (1, 64), (64, 64), (5, 17)])
def test_topk_positions_round_trip_for_any_choice(k, chunk):
    codec = codec_of("topk", CompressionConfig(topk_k=k, topk_chunk=chunk))
    g = torch.Generator().manual_seed(k)
    for x in (torch.randn(7 * chunk + chunk // 2 + 1, generator=g), torch.randn(3 * chunk, generator=g) ** 9):
        restored = codec.roundtrip(x)
        for start in range(0, x.numel(), chunk):  # each chunk keeps exactly its largest values, at their places
            piece, kept = x[start : start + chunk], restored[start : start + chunk]
            expected = min(piece.numel(), max(1, -(-k * piece.numel() // chunk)))
            assert int((kept != 0).sum()) == expected
            assert set(kept.nonzero().view(-1).tolist()) == set(piece.abs().topk(expected).indices.tolist())
        assert len(codec.compress(x)) == codec.payload_bytes(x.numel())


def test_topk_positions_that_do_not_decode_to_k_a_chunk_are_refused():
    codec = codec_of("topk", CompressionConfig(topk_k=4, topk_chunk=64))
    x = torch.randn(128)
    payload = bytearray(codec.compress(x))
    payload[HEADER_BYTES + 4 * 2 + 2] ^= 0x10  # a bit of the first chunk's upper bitmap
    with pytest.raises(PayloadError, match="top-k positions"):
        codec.decompress(bytes(payload), 128)


@pytest.mark.parametrize("name", CODECS)
def test_bad_payloads_are_rejected_with_a_reason(name):
    codec = codec_of(name)
    x = torch.randn(100)
    payload = codec.compress(x)
    with pytest.raises(PayloadError, match="truncated|expected"):
        codec.decompress(payload[: len(payload) // 2], 100)
    with pytest.raises(PayloadError, match="truncated"):
        codec.decompress(payload[: HEADER_BYTES - 1], 100)
    with pytest.raises(PayloadError, match="holds 99 values, expected 100"):
        codec.decompress(codec.compress(x[:99]), 100)
    with pytest.raises(PayloadError, match="non-finite"):
        codec.decompress(codec.compress(torch.full((100,), math.nan)), 100)
    with pytest.raises(PayloadError, match="not a diloco"):
        codec.decompress(b"XX" + payload[2:], 100)
    other = "int8" if name != "int8" else "int4"
    with pytest.raises(PayloadError, match="same compression"):
        codec.decompress(codec_of(other).compress(x), 100)


def test_a_codec_with_other_parameters_is_a_mismatch():
    with pytest.raises(PayloadError, match=r"int8\(16, 0\), expected int8\(8, 0\)"):
        codec_of("int8").decompress(codec_of("int8", CompressionConfig(block_size=16)).compress(torch.ones(50)), 50)


def test_topk_positions_out_of_range_are_rejected():
    codec = codec_of("topk")
    payload = bytearray(codec.compress(torch.randn(32)))
    payload[HEADER_BYTES + 4 : HEADER_BYTES + 6] = (40).to_bytes(2, "little")  # first position: 40 >= 32
    with pytest.raises(PayloadError, match="positions"):
        codec.decompress(bytes(payload), 32)


@pytest.mark.parametrize("name", ["fp16", "int8", "int4", "topk"])
def test_error_feedback_makes_the_sum_of_what_was_sent_track_the_sum_of_inputs(name):
    codec = codec_of(name)
    feedback = ErrorFeedback(codec, enabled=True)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(200, generator=g) for _ in range(60)]
    sent_total, input_total = torch.zeros(200), torch.zeros(200)
    for x in inputs:
        (corrected,) = feedback.apply([x])
        sent_total += codec.roundtrip(corrected)
        input_total += x
        # what was sent plus what is still owed is exactly what came in
        torch.testing.assert_close(sent_total + feedback.residuals[0], input_total, atol=1e-4, rtol=1e-5)
    # the residual stays bounded (it does not grow with the rounds): the sum of what was sent converges
    assert feedback.residuals[0].abs().max() < 0.2 * input_total.abs().max() + 10
    without = sum(codec.roundtrip(x) for x in inputs)
    assert (sent_total - input_total).norm() <= (without - input_total).norm() + 1e-4


@pytest.mark.parametrize("decay", [1.0, 0.85])
def test_a_round_that_sent_nothing_gives_the_residual_back_as_it_was(decay):
    feedback = ErrorFeedback(codec_of("int8"), enabled=True, decay=decay)
    g = torch.Generator().manual_seed(1)
    feedback.apply([torch.randn(300, generator=g)])
    before = feedback.residuals[0].clone()
    raw = torch.randn(300, generator=g)
    (sent,) = feedback.apply([raw])
    assert not torch.allclose(feedback.residuals[0], before)
    feedback.take_back([sent], [raw])
    torch.testing.assert_close(feedback.residuals[0], before, atol=1e-5, rtol=1e-5)


def test_error_feedback_state_round_trips_and_is_off_for_lossless_codecs():
    feedback = ErrorFeedback(codec_of("topk"), enabled=True)
    feedback.apply([torch.randn(100)])
    restored = ErrorFeedback(codec_of("topk"), enabled=True)
    restored.load_state_dict(feedback.state_dict())
    assert torch.equal(restored.residuals[0], feedback.residuals[0])
    assert not ErrorFeedback(codec_of("none"), enabled=True).enabled


def test_average_payloads_drops_a_bad_contribution_and_keeps_the_others(caplog):
    codec = codec_of("int8")
    a, b = torch.ones(20), torch.full((20,), 3.0)
    contributions = [
        Contribution("worker 0", [codec.compress(a)], 1.0),
        Contribution("worker 1", [codec.compress(torch.full((20,), math.nan))], 1.0),
        Contribution("worker 2", [codec.compress(b)], 1.0),
        Contribution("worker 3", [codec.compress(a)], math.inf),
    ]
    means, used = average_payloads(codec, contributions, [20], round_index=4)
    assert [c.worker for c in used] == ["worker 0", "worker 2"]
    torch.testing.assert_close(means[0], torch.full((20,), 2.0), rtol=1e-2, atol=0)
    assert "round 5: dropped the contribution of worker 1: payload decodes to non-finite values" in caplog.text
    assert "dropped the contribution of worker 3: weight inf" in caplog.text


def test_error_feedback_survives_a_diverged_step():
    feedback = ErrorFeedback(codec_of("int8"), enabled=True)
    feedback.apply([torch.randn(20)])
    (sent,) = feedback.apply([torch.full((20,), math.inf)])  # peers will drop it; the worker must not crash
    assert not bool(torch.isfinite(sent).all())
    assert bool((feedback.residuals[0] == 0).all())


def test_all_finite_finds_a_nan_or_an_infinity_and_is_not_fooled_by_a_sum_that_overflows():
    from diloco.compression import all_finite

    values = torch.zeros(1000)
    assert all_finite(values)
    for bad in (math.nan, math.inf, -math.inf):
        values[517] = bad
        assert not all_finite(values)
    assert all_finite(torch.full((4,), 3e38))  # finite values whose sum is not


def test_error_feedback_with_a_decay_carries_beta_times_the_residual_into_each_round():
    codec, beta = codec_of("topk"), 0.95
    feedback = ErrorFeedback(codec, enabled=True, decay=beta)
    g = torch.Generator().manual_seed(1)
    residual = torch.zeros(300)
    for _ in range(3):  # by hand: c = g + beta e; e = c - restore(c)
        x = torch.randn(300, generator=g)
        (sent,) = feedback.apply([x])
        expected = x + beta * residual
        torch.testing.assert_close(sent, expected, rtol=0, atol=1e-6)
        residual = expected - codec.restore(expected)
        torch.testing.assert_close(feedback.residuals[0], residual, rtol=0, atol=1e-6)
    assert not torch.equal(residual, torch.zeros(300))


def test_topk_gathered_mean_takes_each_value_over_the_senders_that_carry_it():
    codec = codec_of("topk", CompressionConfig(topk_k=2, topk_chunk=8, topk_mean="senders"))
    a = torch.tensor([3.0, 0, 0, 0, 0, 0, 1, 0])
    b = torch.tensor([1.0, 0, 5, 0, 0, 0, 0, 0])
    silent = torch.zeros(8)  # a chunk whose scale is 0 carries nothing
    mean = codec.gathered_mean([(a, 1.0), (b, 3.0), (silent, 2.0)], 8)
    assert torch.equal(mean, torch.tensor([(3 + 3 * 1) / 4, 0, 5, 0, 0, 0, 1, 0]))  # alone: what was sent
    again = codec.gathered_mean([(a, 1.0), (b, 3.0), (silent, 2.0)], 8)
    assert torch.equal(mean, again)
    over_all = codec_of("topk", CompressionConfig(topk_k=2, topk_chunk=8, topk_mean="all"))
    assert torch.equal(over_all.gathered_mean([(a, 1.0), (b, 3.0), (silent, 2.0)], 8), (a + 3 * b) / 6)
    dense = codec_of("int8").gathered_mean([(a, 1.0), (b, 3.0)], 8)  # another codec: over all of them
    assert torch.equal(dense, (a + 3 * b) / 4)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_topk_values_take_as_many_levels_as_their_bits_allow(bits):
    codec = codec_of("topk", CompressionConfig(topk_k=16, topk_chunk=64, topk_value_bits=bits))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    payload = codec.compress(x)
    # a scale a chunk, 2 low bits and an upper bitmap of 16 + 16 bits a position, bits a value
    assert len(payload) == HEADER_BYTES + 2 * 4 + 2 * (16 * 2 + 16 + 16) // 8 + 2 * 16 * bits // 8
    out = codec.decompress(payload, x.numel()).view(2, 64)
    for row, sent in zip(x, out):
        kept = row.abs().topk(16).indices
        assert set(sent.nonzero().view(-1).tolist()) == set(kept.tolist())
        if bits == 1:  # the sign, times the mean kept magnitude
            torch.testing.assert_close(sent[kept], row[kept].sign() * row[kept].abs().mean(), rtol=0, atol=1e-6)
            continue
        scale, steps = row[kept].abs().max(), 2**bits - 1  # levels -1 + 2i / steps, times the scale
        level = (sent[kept] / scale + 1) * steps / 2
        torch.testing.assert_close(level, level.round(), rtol=0, atol=1e-4)
        assert float((sent[kept] - row[kept]).abs().max()) <= float(scale) / steps * 1.0001
    if bits == 1:  # fewer nonzero values than k: the scale is their mean magnitude, zeros do not shrink it
        few = codec.roundtrip(torch.tensor([3.0, -1.0] + [0.0] * 62))
        assert float(few[0]) == 2.0 and float(few[1]) == -2.0


def test_peers_of_another_top_k_setting_refuse_each_others_payloads():
    base = CompressionConfig(name="topk")
    payload = build_codec(base).compress(torch.randn(8192))
    for key, value in (("topk_value_bits", 4), ("topk_mean", "senders"), ("topk_k", 32)):
        other = build_codec(CompressionConfig(**{**base.__dict__, key: value}))
        with pytest.raises(PayloadError, match=r"topk\(k=64, chunk=4096, value_bits=2, mean=all\)"):
            other.decompress(payload, 8192)


def test_topk_positions_out_of_range_or_out_of_order_are_refused():
    codec = codec_of("topk", CompressionConfig(topk_k=2, topk_chunk=5))  # low bits 1, upper bitmap 2 + 3 bits
    x = torch.tensor([5.0, 0, 0, 0, 4])
    payload = bytearray(codec.compress(x))
    # one chunk: its scale (4 bytes), then the bits from the lowest: the low bits of positions 0
    # and 4 (0, 0), then the upper bitmap, a one at h + i for h = 0 and 2 (1 0 0 1 0)
    position_byte = HEADER_BYTES + 4
    assert payload[position_byte] == 0b0010_0100
    payload[position_byte] = 0b0010_0110  # the second position's low bit set: 5, out of a chunk of 5
    with pytest.raises(PayloadError, match="out of range or out of order"):
        codec.decompress(bytes(payload), 5)
    payload[position_byte] = 0b0000_1101  # h 0 and 0, low bits 1 then 0: positions 1, then 0
    with pytest.raises(PayloadError, match="out of range or out of order"):
        codec.decompress(bytes(payload), 5)
