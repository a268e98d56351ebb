"""``inner.optimizer=muon``: Muon for a model's hidden matrices, AdamW for the rest, as one optimizer.

Muon (Jordan et al., 2024; ``torch.optim.Muon``) orthogonalises each hidden weight matrix's
momentum with a few Newton-Schulz iterations before the step; it is defined for matrices only.
The usual split: the weights of the linear layers inside the model (attention, MLP) take Muon;
the embeddings, the output head (tied to the token embedding in the built-in GPT), norms and
biases take AdamW with the run's ``inner.*`` settings. Muon's step is scaled to match AdamW's
update RMS (``adjust_lr_fn="match_rms_adamw"``: Moonshot's rule), so it runs on the inner
learning-rate schedule as it is, times ``inner.muon_lr_scale``, with the same decoupled weight
decay. Which matrices are hidden is read from the modules, so the built-in GPT and Hugging Face
causal LMs (their ``get_output_embeddings``) split alike; a model without a hidden matrix is
refused in one line.
"""

from __future__ import annotations

import torch
from torch import nn

from diloco.errors import ConfigError


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The weights of the model's linear layers that are neither an embedding nor the output head
    (nor tied to one), in module order."""
    outer = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():  # the output head: GPT's lm_head, a transformers model's own
        head = getattr(module, "lm_head", None)
        if head is None and callable(getattr(module, "get_output_embeddings", None)):
            head = module.get_output_embeddings()
        if isinstance(head, nn.Module) and isinstance(getattr(head, "weight", None), torch.Tensor):
            outer.add(id(head.weight))
    found: dict[int, nn.Parameter] = {}  # by id: a weight shared by two layers once
    for module in model.modules():
        weight = module.weight if isinstance(module, nn.Linear) else None
        if weight is not None and weight.requires_grad and weight.dim() == 2 and id(weight) not in outer:
            found.setdefault(id(weight), weight)
    return list(found.values())


class MuonWithAdamW:
    """One optimizer to the inner loop (``param_groups``, ``step``, ``zero_grad``, ``state_dict``):
    ``torch.optim.Muon`` over ``hidden``, ``torch.optim.AdamW`` over every other trainable param
    (decay on its matrices only, as the AdamW inner optimizer). Each group's ``lr_scale`` is what
    the inner loop multiplies the scheduled lr by."""

    def __init__(self, model: nn.Module, cfg, *, fused: bool):
        hidden = hidden_matrices(model)
        if not hidden:
            raise ConfigError(
                "inner.optimizer=muon needs hidden weight matrices (linear layers besides the embeddings and the "
                "output head); this model has none: use inner.optimizer=adamw"
            )
        taken = {id(p) for p in hidden}
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
        self.muon = torch.optim.Muon(
            [{"params": hidden, "lr_scale": cfg.muon_lr_scale}],
            lr=cfg.lr * cfg.muon_lr_scale,
            weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum,
            nesterov=True,
            ns_steps=cfg.muon_ns_steps,
            adjust_lr_fn="match_rms_adamw",
        )
        groups = [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay, "lr_scale": 1.0},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, "lr_scale": 1.0},
        ]
        self.adamw = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None
        )

    @property
    def param_groups(self) -> list[dict]:
        return [*self.muon.param_groups, *self.adamw.param_groups]

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ConfigError(
                "the checkpoint's inner optimizer state is not Muon's: resume with the inner.optimizer it was "
                "written with (its config.yaml)"
            )
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
