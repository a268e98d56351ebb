"""Evaluation: a model's loss on held-out batches (each, or their mean), and a cache for workers
simulated in one process that hold the same params (``comm.backend=simulator``: one evaluation
each round, not M). Workers in processes of their own split the batches instead (shared_evaluation.py).

    val_loss = evaluate(model, batches)      # batches: diloco.data.corpus.val_batches(...)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


@torch.no_grad()
def batch_losses(
    model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], indices: Iterable[int]
) -> list[float]:
    """The loss of ``model`` on each of ``batches[i]`` for ``i`` in ``indices``, in that order, in eval
    mode; the model's mode is restored after."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        losses = []
        for i in indices:
            x, y = batches[i]
            _, loss = model(x.to(device), targets=y.to(device))
            losses.append(loss.item())  # one host sync per batch; eval is rare enough not to matter
    finally:
        model.train(was_training)
    return losses


def mean_loss(losses: Sequence[float]) -> float:
    """The mean of per-batch losses, summed in their order: the same float wherever they were computed."""
    if not losses:
        raise ValueError("evaluate needs at least one batch")
    total = 0.0
    for loss in losses:
        total += loss
    return total / len(losses)


def evaluate(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss of ``model`` over ``batches``, in eval mode; the model's mode is restored after."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    return mean_loss(batch_losses(model, batches, range(len(batches))))


# Workers simulated in one process (comm.backend=simulator) with blocking rounds hold bit-identical
# params after every round: each distinct set of params is evaluated once, keyed by its hash and
# the held-out set's.
_EVALUATED: dict[tuple[str, str], float] = {}


def evaluate_cached(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], key: tuple[str, str]) -> float:
    """``evaluate``, once per ``key`` (the hash of the params, the hash of ``batches``) in this process."""
    if key not in _EVALUATED:
        if len(_EVALUATED) > 256:
            _EVALUATED.clear()
        _EVALUATED[key] = evaluate(model, batches)
    return _EVALUATED[key]
