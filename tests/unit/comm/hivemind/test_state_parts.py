"""A state laid out in parts: the parts cover its bytes exactly, a manifest checks each part, and a
plan hands out every missing part once."""

from __future__ import annotations

import torch

from diloco.comm.hivemind.state_parts import (
    Manifest,
    Plan,
    agreed,
    byte_views,
    flatten,
    manifest_of,
    part_bytes_for,
    read_range,
    write_range,
)


def _state(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(37, 11, generator=generator), torch.randn(5000, generator=generator), torch.zeros(())]
    optimizer = {
        "state": {i: {"momentum_buffer": torch.randn(p.shape, generator=generator)} for i, p in enumerate(params)},
        "param_groups": [{"lr": 0.7, "momentum": 0.9, "nesterov": True, "betas": (0.9, 0.95), "params": [0, 1, 2]}],
    }
    return {"global_params": [*params[:2], params[2].to(torch.bfloat16)], "optimizer": optimizer}


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_parts_cover_the_state_exactly_and_rebuild_it():
    state = _state()
    manifest = manifest_of(state)
    views = byte_views(flatten(state)[1])
    total = sum(v.nbytes for v in views)
    assert manifest.total_bytes == total
    spans = [manifest.span(i) for i in range(manifest.parts)]
    assert spans[0][0] == 0 and spans[-1][1] == total  # end to end, no gap, no overlap
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert manifest.parts > 32  # a small state is still cut for several peers

    tensors = manifest.allocate()
    targets = byte_views(tensors)
    for part, (start, end) in enumerate(spans):
        data = read_range(views, start, end)
        assert manifest.holds(part, data)
        write_range(targets, start, data)
    assert _same(manifest.state(tensors), state)


def test_a_part_with_one_byte_changed_does_not_hold():
    state = _state()
    manifest = manifest_of(state)
    start, end = manifest.span(3)
    data = bytearray(read_range(byte_views(flatten(state)[1]), start, end))
    data[7] ^= 1
    assert not manifest.holds(3, bytes(data))
    assert not manifest.holds(manifest.parts, b"")  # no such part


def test_a_manifest_crosses_the_wire_unchanged():
    manifest = manifest_of(_state())
    assert Manifest.from_wire(manifest.to_wire()).digest() == manifest.digest()
    assert manifest_of(_state(1)).digest() != manifest.digest()


def test_the_part_size_stays_within_its_bounds():
    assert part_bytes_for(10) == 256
    assert part_bytes_for(64 * 8192) == 8192
    assert part_bytes_for(683_000_000) == 1 << 20


def test_the_manifest_two_peers_agree_on_wins_over_the_first_peers_own():
    honest, other = manifest_of(_state()), manifest_of(_state(1))
    served = {"a": (other, b"m"), "b": (honest, b"m"), "c": (honest, b"m")}
    manifest, metadata, peers = agreed(served, ["a", "b", "c"])
    assert manifest.digest() == honest.digest() and peers == ["b", "c"]
    assert agreed({"a": (other, b"m"), "b": (honest, b"m")}, ["a", "b"])[2] == ["a"]  # no majority: the best offer


def test_a_plan_hands_out_each_missing_part_once_and_takes_back_what_did_not_come():
    plan = Plan(20, span=8)
    a, b = plan.take("a"), plan.take("b")
    assert (a, b) == (range(0, 8), range(8, 16))
    for part in b:
        plan.landed(part, "b")
    plan.refuse("a", a)  # a served a bad part: its parts go back, it takes no more
    assert plan.take("a") is None
    assert plan.take("b") == range(0, 8) and plan.take("b") == range(16, 20)
    assert plan.take("b") is None and not plan.done
