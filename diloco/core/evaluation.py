"""Evaluation: a model's mean loss over held-out batches, and a cache for workers simulated in one
process that hold the same params (``comm.backend=simulator``: one evaluation each round, not M).

    val_loss = evaluate(model, batches)      # batches: diloco.data.corpus.val_batches(...)
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss of ``model`` over ``batches``, in eval mode; the model's mode is restored after."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        total = 0.0
        for x, y in batches:
            _, loss = model(x.to(device), targets=y.to(device))
            total += loss.item()  # one host sync per batch; eval is rare enough not to matter
    finally:
        model.train(was_training)
    return total / len(batches)


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
