"""The outer step's math: DiLoCo with H=1, inner SGD and outer SGD(lr 1) is data-parallel SGD;
the Nesterov outer step matches a hand-computed update; a failed round falls back cleanly, and
takes a better peer's whole state through the recovery protocol (its cases: test_recovery.py)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from diloco.comm.base import Averaging, Membership, Outcome, PeerState, StateExchange, StateRank, SyncResult
from diloco.core.inner import InnerConfig, build_inner_optimizer, inner_step
from diloco.core.outer import OuterConfig, OuterStep, build_outer_optimizer
from diloco.core.recovery import Recovery, RoundOutcome
from diloco.data.corpus import ShardSampler
from diloco.models.config import ModelConfig
from diloco.models.gpt import build_model

TINY = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


def _batches(num_workers: int, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    tokens = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    samplers = [
        ShardSampler(tokens, block_size=16, batch_size=4, shard_index=i, num_shards=num_workers, seed=1)
        for i in range(num_workers)
    ]
    return [[s.next_batch() for _ in range(steps)] for s in samplers]


def _weighted_mean(tensor_lists: list[list[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
    total = sum(weights)
    return [sum(w * ts[k] for w, ts in zip(weights, tensor_lists)) / total for k in range(len(tensor_lists[0]))]


@pytest.mark.parametrize("num_workers", [2, 4])
def test_diloco_with_h1_inner_sgd_outer_sgd_lr1_equals_data_parallel_sgd(num_workers):
    steps, lr = 3, 0.05
    batches = _batches(num_workers, steps)
    torch.manual_seed(0)
    reference = build_model(TINY)
    workers = [copy.deepcopy(reference) for _ in range(num_workers)]

    # synchronous data-parallel SGD: the mean of the workers' gradients, one step each time
    ddp_optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for step in range(steps):
        grads = []
        for w in range(num_workers):
            reference.zero_grad()
            _, loss = reference(*batches[w][step])
            loss.backward()
            grads.append([p.grad.clone() for p in reference.parameters()])
        for param, grad in zip(reference.parameters(), _weighted_mean(grads, [1.0] * num_workers)):
            param.grad = grad
        ddp_optimizer.step()

    # DiLoCo: H=1, inner SGD, outer SGD lr 1 momentum 0 (plain averaging)
    inner_cfg = InnerConfig(optimizer="sgd", lr=lr, grad_clip=0.0)
    outer_cfg = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0, sync_every=1)
    inner_optimizers = [build_inner_optimizer(inner_cfg, m) for m in workers]
    outers = [OuterStep(list(m.parameters()), outer_cfg) for m in workers]
    for step in range(steps):
        for w in range(num_workers):
            inner_step(workers[w], inner_optimizers[w], batches[w][step], lr=lr, grad_clip=0.0)
        average = _weighted_mean([o.pseudo_gradients() for o in outers], [4.0] * num_workers)
        for outer in outers:
            outer.apply([t.clone() for t in average])

    for w in range(num_workers):
        for got, want in zip(workers[w].parameters(), reference.parameters()):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_nesterov_outer_step_matches_hand_computed_update():
    cfg = OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9)
    local = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    outer = OuterStep([local], cfg)
    theta = torch.tensor([1.0, -2.0, 3.0])
    velocity = torch.zeros(3)
    for delta in (torch.tensor([0.1, 0.2, -0.3]), torch.tensor([-0.05, 0.4, 0.0])):
        with torch.no_grad():
            local.copy_(outer.global_params[0] - delta)  # inner steps moved the params by -delta
        pseudo_gradient = outer.pseudo_gradients()[0]
        torch.testing.assert_close(pseudo_gradient, delta)
        outer.apply([pseudo_gradient])
        # SGD with Nesterov: v = mu v + g ; theta -= lr (g + mu v)
        velocity = 0.9 * velocity + delta
        theta = theta - 0.7 * (delta + 0.9 * velocity)
        torch.testing.assert_close(outer.global_params[0], theta)
        torch.testing.assert_close(local.detach(), theta)  # local params restart from the global ones


def test_outer_optimizer_factory_builds_each_kind():
    params = [torch.zeros(2, requires_grad=True)]
    sgd = build_outer_optimizer(OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0), params)
    assert isinstance(sgd, torch.optim.SGD) and not sgd.defaults["nesterov"]
    nesterov = build_outer_optimizer(OuterConfig(), params)
    assert nesterov.defaults["nesterov"] and nesterov.defaults["momentum"] == 0.9
    no_momentum = build_outer_optimizer(OuterConfig(lr=1.0, momentum=0.0), params)  # torch refuses Nesterov at 0
    assert not no_momentum.defaults["nesterov"] and no_momentum.defaults["momentum"] == 0.0
    assert isinstance(build_outer_optimizer(OuterConfig(optimizer="adam", lr=0.1), params), torch.optim.Adam)
    with pytest.raises(ValueError, match="outer.optimizer"):
        build_outer_optimizer(OuterConfig(optimizer="lion"), params)


class _FailingTransport(Averaging, StateExchange):
    """Averaging fails; a peer may offer the state it reached in a bigger group."""

    def __init__(self, peer_state=None, peer_round=None):
        self.peer_state, self.peer_round, self.published, self.asked = peer_state, peer_round, [], []

    def all_reduce_mean(self, tensors, weight, *, round_index, deadline_s):
        return SyncResult(Outcome.FAILED, peers=1, total_weight=weight, error="nobody came")

    def publish_state(self, round_index, rank, state):
        self.published.append((round_index, rank.peers))

    def fetch_state(self, round_index, *, better_than, timeout_s, newer=False, check=None):
        self.asked.append((round_index, better_than.peers))
        if self.peer_state is None:
            return None
        taken = round_index if self.peer_round is None else self.peer_round
        return PeerState(taken, StateRank(better_than.peers + 1), self.peer_state)


def _sync(outer: OuterStep, transport: _FailingTransport, *, round_index: int, expected_peers: int):
    """A blocking round as worker/sync_modes.py runs it: ``outer.sync`` over ``transport``, then the
    recovery of ``outer``'s state through the transport's state exchange. Returns (result, taken round)."""
    result = outer.sync(transport, weight=1.0, deadline_s=1.0, round_index=round_index)
    if result.outcome is Outcome.POSTPONED:
        return result, None
    recovery = Recovery(outer, transport, Membership())
    outcome = RoundOutcome.of(result, round_index)
    return result, recovery.after_round(outcome, expected_peers=expected_peers, timeout_s=1.0)


def test_failed_round_without_better_peer_applies_the_workers_own_pseudo_gradient():
    local = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    outer = OuterStep([local], OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0))
    with torch.no_grad():
        local.sub_(torch.tensor([0.5, 0.25]))
    backend = _FailingTransport()
    result, recovered = _sync(outer, backend, round_index=3, expected_peers=2)
    assert not result.ok and result.error == "nobody came" and recovered is None
    torch.testing.assert_close(outer.global_params[0], torch.tensor([0.5, 1.75]))
    assert backend.published == [(3, 1)] and backend.asked == [(3, 1)]


def test_a_postponed_round_takes_no_outer_step_and_its_steps_count_toward_the_next_round():
    local = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    outer = OuterStep([local], OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0))
    backend = _FailingTransport()
    backend.all_reduce_mean = lambda tensors, weight, **_: SyncResult(Outcome.POSTPONED, 1, weight, error="nobody")
    with torch.no_grad():
        local.sub_(torch.tensor([0.5, 0.25]))
    result, recovered = _sync(outer, backend, round_index=3, expected_peers=2)
    assert result.outcome is Outcome.POSTPONED and recovered is None and backend.published == backend.asked == []
    torch.testing.assert_close(outer.global_params[0], torch.tensor([1.0, 2.0]))  # no outer step, not even alone
    torch.testing.assert_close(local.detach(), torch.tensor([0.5, 1.75]))  # the local params train on
    torch.testing.assert_close(outer.pseudo_gradients()[0], torch.tensor([0.5, 0.25]))


def test_failed_round_takes_the_state_of_a_peer_from_a_bigger_group():
    peer_local = torch.nn.Parameter(torch.tensor([7.0, 8.0]))
    peer = OuterStep([peer_local], OuterConfig())
    with torch.no_grad():
        peer_local.sub_(0.5)
    peer.apply(peer.pseudo_gradients())

    local = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    outer = OuterStep([local], OuterConfig())
    _, recovered = _sync(outer, _FailingTransport(peer.state_dict()), round_index=0, expected_peers=4)
    assert recovered == 0
    torch.testing.assert_close(outer.global_params[0], peer.global_params[0])
    torch.testing.assert_close(local.detach(), peer.global_params[0])
    momentum = outer.optimizer.state[outer.global_params[0]]["momentum_buffer"]
    torch.testing.assert_close(momentum, peer.optimizer.state[peer.global_params[0]]["momentum_buffer"])


def test_a_worker_left_behind_takes_a_later_rounds_state_and_says_which():
    peer = OuterStep([torch.nn.Parameter(torch.tensor([3.0]))], OuterConfig())
    outer = OuterStep([torch.nn.Parameter(torch.tensor([1.0]))], OuterConfig())
    backend = _FailingTransport(peer.state_dict(), peer_round=7)
    _, taken = _sync(outer, backend, round_index=4, expected_peers=3)
    assert taken == 7 and backend.published[-1] == (7, 2)
    torch.testing.assert_close(outer.global_params[0], torch.tensor([3.0]))


def test_outer_state_round_trips_through_state_dict():
    local = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    outer = OuterStep([local], OuterConfig())
    with torch.no_grad():
        local.sub_(0.1)
    outer.apply(outer.pseudo_gradients())
    restored = OuterStep([torch.nn.Parameter(torch.zeros(2))], OuterConfig())
    restored.load_state_dict(outer.state_dict())
    torch.testing.assert_close(restored.global_params[0], outer.global_params[0])
    momentum = outer.optimizer.state[outer.global_params[0]]["momentum_buffer"]
    torch.testing.assert_close(restored.optimizer.state[restored.global_params[0]]["momentum_buffer"], momentum)


def test_groups_of_a_split_round_agree_on_one_winner():
    """Two groups of two averaged the same round apart: the one whose fingerprint is smaller takes
    the other's state, and the winner takes nobody's."""
    a = OuterStep([torch.nn.Parameter(torch.tensor([1.0]))], OuterConfig())
    b = OuterStep([torch.nn.Parameter(torch.tensor([2.0]))], OuterConfig())
    loser, winner = sorted([a, b], key=OuterStep.fingerprint)
    assert StateRank(2, loser.fingerprint()) < StateRank(2, winner.fingerprint()) < StateRank(3, 0.0)
    assert a.fingerprint() == OuterStep([torch.nn.Parameter(torch.tensor([1.0]))], OuterConfig()).fingerprint()


def test_the_offered_state_is_the_live_one_read_on_request_and_withdrawn_by_the_next_outer_step():
    model = build_model(TINY)
    outer = OuterStep(list(model.parameters()), OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9))
    offer = outer.offered_state()
    seen = offer(lambda state: state["global_params"][0])
    assert seen is outer.global_params[0] or seen.data_ptr() == outer.global_params[0].data_ptr()  # no copy
    outer.apply([torch.full_like(p, 0.1) for p in outer.global_params])
    assert offer(lambda state: state) is None  # stale: an outer step changed the state since
    fresh = outer.offered_state()(lambda state: torch.save(state, io.BytesIO()) or state["optimizer"]["state"])
    assert len(fresh) == len(outer.global_params)  # the momentum is in what a peer downloads
