"""The inner loop's parts: the local optimizer, its learning-rate schedule, and one inner step.

Inner optimizer state never leaves the worker (DiLoCo, arXiv:2311.08105, section 2): only
parameters are averaged, in the outer step.

On a GPU: ``precision="bf16"`` runs the forward (and so the backward's matmuls) under
``torch.autocast`` in bfloat16 while the params, their gradients and the optimizer state stay fp32
(the master copy the outer step reads); bf16 needs no loss scaling, unlike fp16. AdamW is the
fused CUDA kernel whenever the params are on a CUDA device (one launch for all params instead of
a few per tensor; same update rule). Both work on the CPU too, which is how the tests run them.
``inner.optimizer=muon`` is Muon for the hidden matrices and AdamW for the rest (``muon.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from diloco.core.muon import MuonWithAdamW
from diloco.errors import require

INNER_OPTIMIZERS = ("adamw", "muon", "sgd")
PRECISIONS = ("fp32", "bf16")


@dataclass
class InnerConfig:
    steps: int = 500  # inner steps per worker, in total over the run
    batch_size: int = 12  # sequences per inner step, per worker
    optimizer: str = "adamw"  # adamw / muon (hidden matrices; AdamW for the rest) / sgd (plain, to check DiLoCo)
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # learning rate at the end of the cosine decay
    warmup_steps: int = 50  # linear warm-up from 0 to lr over these inner steps; M>1 DiLoCo wants more than DDP
    weight_decay: float = 0.1  # AdamW decoupled weight decay, on matrices only
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # clip the gradient norm to this; 0 = no clipping
    muon_lr_scale: float = 4.0  # muon: its lr is inner.lr's schedule times this (its update matched to AdamW's RMS)
    muon_momentum: float = 0.95  # muon: Nesterov momentum of the hidden matrices' gradients
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations that orthogonalise each update


def validate_inner_config(cfg: InnerConfig) -> None:
    """Raise ``ConfigError`` naming the ``inner.*`` setting to change."""
    require(cfg.steps >= 1, f"inner.steps={cfg.steps} must be at least 1")
    require(cfg.batch_size >= 1, f"inner.batch_size={cfg.batch_size} must be at least 1")
    require(
        cfg.optimizer in INNER_OPTIMIZERS,
        f"inner.optimizer={cfg.optimizer!r} is not one of {', '.join(INNER_OPTIMIZERS)}",
    )
    require(cfg.lr > 0, f"inner.lr={cfg.lr} must be positive")
    require(0 <= cfg.min_lr <= cfg.lr, f"inner.min_lr={cfg.min_lr} must be in [0, inner.lr]")
    require(cfg.warmup_steps >= 0, f"inner.warmup_steps={cfg.warmup_steps} must be >= 0")
    require(cfg.grad_clip >= 0, f"inner.grad_clip={cfg.grad_clip} must be >= 0 (0 = off)")
    require(cfg.muon_lr_scale > 0, f"inner.muon_lr_scale={cfg.muon_lr_scale} must be positive")
    require(0 <= cfg.muon_momentum < 1, f"inner.muon_momentum={cfg.muon_momentum} must be in [0, 1)")
    require(cfg.muon_ns_steps >= 1, f"inner.muon_ns_steps={cfg.muon_ns_steps} must be at least 1")


def build_inner_optimizer(cfg: InnerConfig, model: nn.Module) -> torch.optim.Optimizer | MuonWithAdamW:
    """AdamW with decay on 2-D weights only (embeddings, linear layers); Muon for the hidden
    matrices and that AdamW for the rest (muon.py); or plain SGD."""
    validate_inner_config(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.is_cuda for p in params)  # the fused kernel is CUDA-only here
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr)
    if cfg.optimizer == "muon":
        return MuonWithAdamW(model, cfg, fused=fused)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


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
    precision: str = "fp32",
) -> torch.Tensor:
    """One local optimizer step on ``batch``. Returns the loss as a tensor: calling ``.item()`` on
    it forces a sync, so the caller does that only when it logs.

    ``average_gradients`` (the data-parallel baseline) runs between backward and the update.
    ``precision`` (fp32 / bf16) is the forward's: bf16 autocasts it on the batch's device."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    inputs, targets = batch
    with autocast(inputs.device, precision):
        _, loss = model(inputs, targets)
    loss.backward()
    if average_gradients is not None:
        average_gradients()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The forward's precision: bf16 autocast on ``device``'s type, or nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    raise ValueError(f"worker.precision={precision!r} is not one of {', '.join(PRECISIONS)}")
