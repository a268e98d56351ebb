"""SparseLoCo (``outer.optimizer=sparseloco``) against the formulas written out by hand: two workers,
two rounds, through the real codec, error feedback, payload average and outer step."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco.comm.base import Averaging, Outcome, SyncResult
from diloco.comm.reduce import Contribution, average_payloads
from diloco.compression import ErrorFeedback, build_codec
from diloco.config import ConfigError, load_config
from diloco.config.rules import SPARSELOCO_PAPER
from diloco.core.outer import OuterStep, build_outer_optimizer

K, CHUNK, BETA = 4, 64, 0.85  # BETA: the rule's compression.error_decay
SHAPES = [(10, 20), (70,)]  # 200 values: three full chunks and a tail; 70: one chunk and a tail


class _Pair:
    """Two workers' rounds averaged through the payload path every transport shares (``average_payloads``)."""

    def __init__(self, codec):
        self.codec, self.barrier, self.sent = codec, threading.Barrier(2), {}

    def backend(self, worker: int) -> Averaging:
        pair = self

        class _Backend(Averaging):
            def all_reduce_mean(self, tensors, weight, *, round_index, deadline_s, fragment=0):
                pair.sent[worker] = Contribution(str(worker), [pair.codec.compress(t) for t in tensors], weight)
                pair.barrier.wait(timeout=10)
                contributions = [pair.sent[0], pair.sent[1]]
                means, used = average_payloads(pair.codec, contributions, [t.numel() for t in tensors], round_index=0)
                pair.barrier.wait(timeout=10)
                for tensor, mean in zip(tensors, means):
                    tensor.copy_(mean.view_as(tensor))
                return SyncResult(Outcome.AVERAGED, len(used), sum(c.weight for c in used))

        return _Backend()


def _top_k_2bit(c: torch.Tensor) -> torch.Tensor:
    """What a worker sends of ``c``: per chunk of CHUNK values its K largest magnitudes, each on one
    of four levels {-1, -1/3, 1/3, 1} times the largest of them (a shorter tail keeps fewer)."""
    flat, out = c.reshape(-1), torch.zeros(c.numel())
    for start in range(0, flat.numel(), CHUNK):
        chunk = flat[start : start + CHUNK]
        kept = min(chunk.numel(), max(1, -(-K * chunk.numel() // CHUNK)))
        index = chunk.abs().argsort(descending=True)[:kept]
        scale = chunk[index].abs().max()
        levels = torch.tensor([-1.0, -1 / 3, 1 / 3, 1.0])
        out[start + index] = levels[torch.round((chunk[index] / scale + 1) * 1.5).long().clamp(0, 3)] * scale
    return out.view_as(c)


def _mean_of_senders(sent: tuple[torch.Tensor, ...], weights: tuple[float, ...]) -> torch.Tensor:
    """Value by value, the weighted mean of what the workers that sent the value sent (0 if none did)."""
    out = torch.zeros_like(sent[0])
    for index in range(out.numel()):
        senders = [(s.reshape(-1)[index], w) for s, w in zip(sent, weights) if s.reshape(-1)[index] != 0]
        if senders:
            out.reshape(-1)[index] = sum(v * w for v, w in senders) / sum(w for _, w in senders)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("momentum", [None, 0.0, 0.3])  # None: the rule's 0.5; 0: a plain step
def test_two_rounds_of_sparseloco_match_the_formulas_written_out_by_hand(momentum):
    overrides = ["outer.optimizer=sparseloco", f"compression.topk_k={K}", f"compression.topk_chunk={CHUNK}"]
    extra = [f"outer.sparseloco_momentum={momentum}"] if momentum is not None else []
    cfg = load_config(None, overrides + extra)
    mu = 0.5 if momentum is None else momentum
    assert (cfg.outer.lr, cfg.outer.sparseloco_momentum) == (1.0, mu)
    assert (cfg.compression.name, cfg.compression.error_decay) == ("topk", BETA)
    codec = build_codec(cfg.compression)
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=g) for shape in SHAPES]
    locals_ = [[torch.nn.Parameter(t.clone()) for t in start] for _ in range(2)]
    outers = [
        OuterStep(locals_[w], cfg.outer, error_feedback=ErrorFeedback(codec, enabled=True, decay=BETA))
        for w in range(2)
    ]
    pair, weights = _Pair(codec), (1.0, 3.0)
    # by hand: e <- beta e + delta; s = topk(e); e <- e - s; u = mean of s over its senders;
    # Nesterov: b <- mu b + u (b = u at first); theta <- theta - lr x (u + mu b)
    theta, errors = [t.clone() for t in start], [[torch.zeros(s) for s in SHAPES] for _ in range(2)]
    buffers = None
    for _ in range(2):
        deltas = [[torch.randn(shape, generator=g) * 0.01 for shape in SHAPES] for _ in range(2)]
        for w in range(2):
            with torch.no_grad():
                for local, global_, delta in zip(locals_[w], outers[w].global_params, deltas[w]):
                    local.copy_(global_ - delta)  # the round's inner steps moved it by -delta
        sent = []
        for w in range(2):
            errors[w] = [BETA * e + d for e, d in zip(errors[w], deltas[w])]
            sent.append([_top_k_2bit(e) for e in errors[w]])
            errors[w] = [e - s for e, s in zip(errors[w], sent[w])]
        mean = [_mean_of_senders((a, b), weights) for a, b in zip(*sent)]
        buffers = mean if buffers is None else [mu * b + m for b, m in zip(buffers, mean)]
        theta = [t - cfg.outer.lr * (m + mu * b) for t, m, b in zip(theta, mean, buffers)]

        threads = [
            threading.Thread(
                target=outers[w].sync,
                args=(pair.backend(w),),
                kwargs={"weight": weights[w], "round_index": 0, "deadline_s": 10.0},
            )
            for w in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        for w in range(2):
            for got, want in zip(outers[w].global_params, theta):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
            for got, want in zip(outers[w].error_feedback.residuals, errors[w]):
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(*(o.global_params for o in outers)))  # bit-identical peers


def test_outer_momentum_leaves_sparseloco_a_plain_step():
    # a run's config.yaml sets every key, outer.momentum (0.9 by default) too
    cfg = load_config(None, ["outer.optimizer=sparseloco", "outer.momentum=0.9", "outer.sparseloco_momentum=0"])
    optimizer = build_outer_optimizer(cfg.outer, [torch.zeros(3, requires_grad=True)])
    assert optimizer.defaults["momentum"] == 0 and not optimizer.defaults["nesterov"]


def test_sparseloco_defaults_to_the_settings_measured_best_and_the_papers_are_one_line_of_overrides():
    cfg = load_config(None, ["outer.optimizer=sparseloco"])
    assert (cfg.outer.lr, cfg.outer.sparseloco_momentum) == (1.0, 0.5)
    compression = cfg.compression
    assert (compression.name, compression.topk_k, compression.topk_chunk) == ("topk", 184, 4096)
    assert (compression.topk_mean, compression.error_feedback, compression.error_decay) == ("senders", True, 0.85)
    paper = load_config(None, ["outer.optimizer=sparseloco", *SPARSELOCO_PAPER])
    assert (paper.outer.sparseloco_momentum, paper.compression.topk_k, paper.compression.error_decay) == (0, 64, 0.95)
    # a run's config.yaml sets every key: a run started before these defaults resumes with its own
    assert load_config(None, ["outer.optimizer=sparseloco", "compression.topk_k=64"]).compression.topk_k == 64


def test_sparseloco_needs_the_error_feedback_of_a_lossy_codec_and_keeps_what_the_user_set():
    cfg = load_config(None, ["outer.optimizer=sparseloco", "compression.error_decay=0.9", "outer.lr=0.8"])
    assert (cfg.outer.lr, cfg.compression.error_decay, cfg.compression.name) == (0.8, 0.9, "topk")
    with pytest.raises(ConfigError, match="outer.optimizer=sparseloco takes its momentum from the error feedback"):
        load_config(None, ["outer.optimizer=sparseloco", "compression.error_feedback=false"])
