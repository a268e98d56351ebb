"""Unit tests for diloco.models.gpt: shapes, init, tying, causality, and that it can learn."""

import math

import pytest
import torch

from diloco.data.source import BYTE_VOCAB_SIZE
from diloco.models.config import ModelConfig
from diloco.models.gpt import GPT, build_model

TINY = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


def _batch(cfg: ModelConfig, batch: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, BYTE_VOCAB_SIZE, (batch, cfg.block_size), generator=g)
    y = torch.randint(0, BYTE_VOCAB_SIZE, (batch, cfg.block_size), generator=g)
    return x, y


def test_forward_returns_logits_per_position_and_no_loss_without_targets():
    torch.manual_seed(0)
    model = build_model(TINY)
    x, _ = _batch(TINY, batch=3)
    logits, loss = model(x[:, :10])
    assert logits.shape == (3, 10, BYTE_VOCAB_SIZE)
    assert loss is None


def test_initial_loss_is_close_to_uniform_over_bytes():
    torch.manual_seed(0)
    model = build_model(ModelConfig())
    _, loss = model(*_batch(ModelConfig(), batch=8))
    assert loss.ndim == 0
    assert abs(loss.item() - math.log(256)) < 0.1


def test_lm_head_shares_the_token_embedding_tensor():
    model = build_model(TINY)
    assert model.lm_head.weight is model.wte.weight


def test_baby_model_has_about_0_8m_parameters_counting_tied_weights_once():
    model = build_model(ModelConfig())
    n = model.num_parameters()
    assert 700_000 <= n <= 900_000
    unique = {id(p): p.numel() for m in model.modules() for p in m.parameters(recurse=False)}
    assert n == sum(unique.values())


def test_residual_projections_are_initialised_smaller():
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=8))
    proj_std = model.blocks[0].mlp.c_proj.weight.std().item()
    fc_std = model.blocks[0].mlp.c_fc.weight.std().item()
    assert proj_std == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert fc_std == pytest.approx(0.02, rel=0.1)


def test_changing_a_later_token_does_not_change_earlier_logits():
    torch.manual_seed(0)
    model = build_model(TINY).eval()
    x, _ = _batch(TINY, batch=2)
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % BYTE_VOCAB_SIZE
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(x2)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_a_few_adamw_steps_on_a_fixed_batch_lower_the_loss():
    torch.manual_seed(0)
    model = build_model(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = _batch(TINY)
    losses = []
    for _ in range(10):
        _, loss = model(x, targets=y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.2


def test_sequence_longer_than_block_size_is_rejected():
    model = build_model(TINY)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_head_count_that_does_not_divide_width_names_both_settings():
    with pytest.raises(ValueError, match=r"model\.n_embd.*model\.n_head"):
        build_model(ModelConfig(n_embd=130, n_head=4))


@pytest.mark.parametrize(
    ("override", "setting"),
    [
        ({"n_layer": 0}, "model.n_layer"),
        ({"block_size": -1}, "model.block_size"),
        ({"dropout": 1.0}, "model.dropout"),
    ],
)
def test_invalid_sizes_and_dropout_are_rejected_by_name(override, setting):
    with pytest.raises(ValueError, match=setting):
        GPT(ModelConfig(**override))
