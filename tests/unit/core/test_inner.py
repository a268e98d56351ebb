"""Inner learning-rate schedule and optimizer groups."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.core.inner import InnerConfig, build_inner_optimizer, lr_at
from diloco.models.config import ModelConfig
from diloco.models.gpt import build_model


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    cfg = InnerConfig(steps=110, lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert lr_at(cfg, 0) == pytest.approx(1e-4)
    assert lr_at(cfg, 9) == pytest.approx(1e-3)
    assert lr_at(cfg, 10) == pytest.approx(1e-3)
    assert lr_at(cfg, 60) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 9e-4)
    assert lr_at(cfg, 110) == pytest.approx(1e-4)
    assert all(lr_at(cfg, s) >= lr_at(cfg, s + 1) for s in range(10, 110))


def test_adamw_decays_matrices_but_not_biases_or_norms():
    model = build_model(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8))
    optimizer = build_inner_optimizer(InnerConfig(weight_decay=0.1), model)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])
    assert isinstance(optimizer, torch.optim.AdamW)
