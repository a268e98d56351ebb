"""The inner loop's parts: the local optimizer, its learning-rate schedule, and one inner step.

Inner optimizer state never leaves the worker (DiLoCo, arXiv:2311.08105, section 2): only
parameters are averaged, in the outer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

INNER_OPTIMIZERS = ("adamw", "sgd")


@dataclass
class InnerConfig:
    steps: int = 500  # inner steps per worker, in total over the run
    batch_size: int = 12  # sequences per inner step, per worker
    optimizer: str = "adamw"  # adamw | sgd (plain SGD, used to check DiLoCo against data-parallel SGD)
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # learning rate at the end of the cosine decay
    warmup_steps: int = 50  # linear warm-up from 0 to lr over this many inner steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay, on matrices only
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # clip the gradient norm to this; 0 = no clipping


def build_inner_optimizer(cfg: InnerConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with decay on 2-D weights only (embeddings, linear layers), or plain SGD."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def lr_at(cfg: InnerConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def inner_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    lr: float,
    grad_clip: float,
    average_gradients: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One local optimizer step on ``batch``. Returns the loss as a tensor: calling ``.item()`` on
    it forces a sync, so the caller does that only when it logs.

    ``average_gradients`` (the data-parallel baseline) runs between backward and the update."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    inputs, targets = batch
    _, loss = model(inputs, targets)
    loss.backward()
    if average_gradients is not None:
        average_gradients()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
