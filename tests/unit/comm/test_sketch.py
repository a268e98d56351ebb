"""The sketch of a contribution: linear, the same over slices as over the whole, and a cosine
that estimates the vectors' own."""

from __future__ import annotations

import torch

from diloco.comm import sketch


def _vector(seed: int, n: int = 50_000) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_the_sketches_of_a_vectors_slices_at_their_offsets_add_up_to_the_whole():
    whole = _vector(0)
    tensors = [whole[:10_000].reshape(100, 100), whole[10_000:]]
    total = sketch.sketch_of(tensors)
    parts = sketch.sketch_of([whole[:7_001]]) + sketch.sketch_of([whole[7_001:]], offset=7_001)
    torch.testing.assert_close(parts, total)
    torch.testing.assert_close(sketch.sketch_of([whole]), total)
    assert not torch.allclose(sketch.sketch_of([whole[7_001:]]), sketch.sketch_of([whole[7_001:]], offset=7_001))


def test_the_sketch_is_linear_and_its_cosine_estimates_the_vectors():
    a, noise = _vector(1), _vector(2)
    b = a + 0.8 * noise
    linear = 2 * sketch.sketch_of([a]) - sketch.sketch_of([b])
    torch.testing.assert_close(sketch.sketch_of([2 * a - b]), linear, rtol=1e-5, atol=1e-5)
    exact = float(a @ b / (a.norm() * b.norm()))
    assert abs(sketch.cosine(sketch.sketch_of([a]), sketch.sketch_of([b])) - exact) < 0.1
    assert abs(sketch.cosine(sketch.sketch_of([a]), sketch.sketch_of([noise]))) < 0.2
    assert sketch.cosine(sketch.sketch_of([a]), sketch.sketch_of([-3 * a])) < -0.999


def test_a_sketch_travels_as_float32_bytes_and_anything_else_is_no_sketch():
    values = sketch.sketch_of([_vector(3)])
    again = sketch.decode(sketch.encode(values))
    torch.testing.assert_close(again, values, rtol=1e-6, atol=1e-4)
    assert sketch.decode(sketch.encode(values)[:-4]) is None
    assert sketch.decode(b"\x00\x00\xc0\x7f" * sketch.SIZE) is None  # NaN
    assert sketch.decode([1.0] * sketch.SIZE) is None
    assert sketch.decode(None) is None
