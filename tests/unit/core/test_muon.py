"""``inner.optimizer=muon`` (core/muon.py): which params Muon takes, the lr schedule on every
group, a resume from its state bit for bit, and the one-line refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from diloco.config import ConfigError, load_config
from diloco.core.inner import InnerConfig, build_inner_optimizer, inner_step
from diloco.core.muon import MuonWithAdamW, hidden_matrices
from diloco.models.config import ModelConfig
from diloco.models.gpt import GPT

TINY = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)
MUON = InnerConfig(optimizer="muon", lr=3e-3, muon_lr_scale=2.0)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def test_muon_takes_the_hidden_matrices_and_adamw_the_embeddings_the_tied_head_norms_and_biases():
    torch.manual_seed(0)
    model = GPT(TINY)
    hidden = {id(p) for p in hidden_matrices(model)}
    names = {name for name, p in model.named_parameters() if id(p) in hidden}
    layers = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert names == {f"blocks.{i}.{layer}.weight" for i in range(2) for layer in layers}, names
    optimizer = build_inner_optimizer(MUON, model)
    assert isinstance(optimizer, MuonWithAdamW)
    assert {id(p) for p in optimizer.muon.param_groups[0]["params"]} == hidden
    adamw = [p for g in optimizer.adamw.param_groups for p in g["params"]]
    assert len(adamw) + len(hidden) == len(list(model.parameters()))  # every param once
    assert any(p is model.wte.weight for p in adamw)  # the embedding, which the output head is tied to


def test_the_lr_schedule_reaches_both_optimizers_muons_scaled_and_a_few_steps_learn():
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizer = build_inner_optimizer(MUON, model)
    losses = [float(inner_step(model, optimizer, _batch(0), lr=1e-2, grad_clip=1.0)) for _ in range(8)]
    assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(2e-2)  # muon_lr_scale x the scheduled lr
    assert all(g["lr"] == pytest.approx(1e-2) for g in optimizer.adamw.param_groups)
    assert losses[-1] < losses[0] - 0.5, losses
    assert optimizer.muon.state and optimizer.adamw.state


def test_a_resume_from_muons_state_continues_bit_for_bit():
    def fresh() -> tuple[nn.Module, MuonWithAdamW]:
        torch.manual_seed(0)
        model = GPT(TINY)
        return model, build_inner_optimizer(MUON, model)

    model, optimizer = fresh()
    for step in range(3):
        inner_step(model, optimizer, _batch(step), lr=1e-2, grad_clip=1.0)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))  # as a checkpoint holds them
    for step in range(3, 5):
        inner_step(model, optimizer, _batch(step), lr=1e-2, grad_clip=1.0)
    resumed, again = fresh()
    resumed.load_state_dict(saved[0])
    again.load_state_dict(saved[1])
    for step in range(3, 5):
        inner_step(resumed, again, _batch(step), lr=1e-2, grad_clip=1.0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))
    with pytest.raises(ConfigError, match="not Muon's: resume with the inner.optimizer it was written with"):
        again.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())


def test_a_model_without_hidden_matrices_and_muon_on_sharded_sites_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="inner.optimizer=muon needs hidden weight matrices") as info:
        build_inner_optimizer(MUON, nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4)))
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="worker.site_sharding=fsdp splits them across ranks"):
        load_config(None, ["inner.optimizer=muon", "worker.site=true", "worker.site_sharding=fsdp"])
    with pytest.raises(ConfigError, match="inner.muon_momentum=1.0 must be in"):
        load_config(None, ["inner.optimizer=muon", "inner.muon_momentum=1"])
    assert load_config(None, ["inner.optimizer=muon"]).inner.optimizer == "muon"


def test_a_hugging_face_llama_splits_the_same_way():
    pytest.importorskip("transformers")
    from diloco.models.hf import build_hf_model

    model = build_hf_model(ModelConfig(kind="hf", hf_config="llama-tiny"), vocab_size=256)
    hidden = {id(p) for p in hidden_matrices(model)}
    names = [name for name, p in model.named_parameters() if id(p) in hidden]
    assert names and all(("self_attn" in n or "mlp" in n) and n.endswith("weight") for n in names), names
    outside = [name for name, p in model.named_parameters() if id(p) not in hidden]
    assert any("embed_tokens" in n for n in outside) and any("lm_head" in n for n in outside), outside
