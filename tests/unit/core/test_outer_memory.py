"""What a round holds beside the global params and the outer momentum, counted allocation by
allocation: over a transport with buffers of its own the pseudo-gradient is formed, averaged and
applied there, so no second whole copy of the params is made (a fresh one without them)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from diloco.comm.base import Averaging, Outcome, Staged, SyncResult
from diloco.core.outer import OuterConfig, OuterStep
from tests.allocations import NewTensors


class _Buffered(Averaging):
    """A transport of one worker that averages in buffers of its own (as hivemind's averager does)."""

    def __init__(self, templates):
        self.buffers = [torch.zeros_like(t) for t in templates]
        self.staged_rounds = 0

    def staging(self, fragment: int = 0):
        return contextlib.nullcontext(self.buffers)

    def all_reduce_mean(self, tensors, weight, *, round_index, deadline_s, fragment=0):
        self.staged_rounds += isinstance(tensors, Staged)
        for buffer, tensor in zip(self.buffers, tensors):  # a transport without buffers of its own copies
            if buffer.data_ptr() != tensor.data_ptr():
                buffer.copy_(tensor)
        return SyncResult(Outcome.AVERAGED, peers=1, total_weight=weight)


class _Unbuffered(_Buffered):
    def staging(self, fragment: int = 0):
        return contextlib.nullcontext(None)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(16)])  # 16 tensors of 256 KB


def _round(averaging_type) -> tuple[int, int, list[torch.Tensor]]:
    model = _model()
    outer = OuterStep(list(model.parameters()), OuterConfig())
    averaging = averaging_type(outer.global_params)
    params_bytes = sum(p.numel() * 4 for p in model.parameters())
    for round_index in range(2):  # the second round: momentum buffers exist, as at any round after the first
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        with NewTensors() as new:
            outer.sync(averaging, weight=1.0, round_index=round_index, deadline_s=5.0)
    assert averaging.staged_rounds == (2 if averaging_type is _Buffered else 0)
    return new.peak_bytes, params_bytes, [p.detach().clone() for p in outer.global_params]


def test_a_round_over_a_transports_buffers_allocates_no_copy_of_the_params():
    peak, params_bytes, _ = _round(_Buffered)
    assert peak <= params_bytes / 8, f"{peak / params_bytes:.2f} x the params' bytes allocated at once"


def test_without_buffers_of_its_own_the_round_makes_a_whole_copy():
    peak, params_bytes, _ = _round(_Unbuffered)
    assert peak >= params_bytes


def test_the_params_are_the_same_either_way():
    _, _, staged = _round(_Buffered)
    _, _, fresh = _round(_Unbuffered)
    assert all(torch.equal(a, b) for a, b in zip(staged, fresh))


class _Scribbling(_Buffered):
    """Its first attempt breaks part-way, leaving garbage in its buffers: it restores the caller's
    contribution and tries again (``retry``), or gives up (the round did not average)."""

    def __init__(self, templates, *, retry: bool):
        super().__init__(templates)
        self.retry = retry

    def all_reduce_mean(self, tensors, weight, *, round_index, deadline_s, fragment=0):
        for buffer in self.buffers:
            buffer.fill_(123.0)
        if not self.retry:
            return SyncResult(Outcome.FAILED, peers=1, total_weight=weight, error="the group broke")
        tensors.restore()
        return super().all_reduce_mean(tensors, weight, round_index=round_index, deadline_s=deadline_s)


class _Held(_Buffered):
    """Its buffers are still held by an all-reduce it gave up on."""

    @contextlib.contextmanager
    def staging(self, fragment: int = 0):
        raise TimeoutError("the averager held its tensors")
        yield


def _params_after(make) -> list[torch.Tensor]:
    model = _model()
    outer = OuterStep(list(model.parameters()), OuterConfig())
    averaging = make(outer.global_params)
    for round_index in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        outer.sync(averaging, weight=1.0, round_index=round_index, deadline_s=5.0)
    return [p.detach().clone() for p in outer.global_params]


@pytest.mark.parametrize("retry", [True, False])
def test_what_a_broken_attempt_leaves_in_the_buffers_is_never_applied(retry):
    fresh = _params_after(_Unbuffered)  # alone, a failed round applies our own pseudo-gradient: the same
    scribbled = _params_after(lambda templates: _Scribbling(templates, retry=retry))
    assert all(torch.equal(a, b) for a, b in zip(scribbled, fresh))


def test_buffers_still_held_by_the_averager_leave_the_round_to_fresh_tensors():
    assert all(torch.equal(a, b) for a, b in zip(_params_after(_Held), _params_after(_Unbuffered)))
