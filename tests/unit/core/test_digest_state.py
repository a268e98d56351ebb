"""The digest a worker declares after a round covers its outer optimizer's state: a downloaded state
whose params are right but whose momentum or learning rate is not reads another digest."""

from __future__ import annotations

import io

import torch

from diloco.config import load_config
from diloco.core.digest import tensors_digest
from diloco.core.outer import OuterStep


def _outer(lr: float = 0.7) -> OuterStep:
    params = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.ones(5)]
    outer = OuterStep(params, load_config(None, ["outer.optimizer=nesterov", f"outer.lr={lr}"]).outer)
    for p in outer.global_params:  # one outer step, so that the momentum exists
        p.grad = torch.full_like(p, 0.5)
    outer.optimizer.step()
    return outer


def test_the_declared_digest_is_the_downloaded_states_and_changes_with_momentum_or_lr():
    outer = _outer()
    declared = outer.declared_digest(tensors_digest(outer.global_params))
    buffer = io.BytesIO()
    torch.save(outer.state_dict(), buffer)  # as a peer serves it
    downloaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert OuterStep.declared_digest_of(downloaded) == declared
    momentum = downloaded["optimizer"]["state"][0]["momentum_buffer"]
    momentum.mul_(10)
    assert OuterStep.declared_digest_of(downloaded) != declared
    momentum.div_(10)
    downloaded["optimizer"]["param_groups"][0]["lr"] = 100.0
    assert OuterStep.declared_digest_of(downloaded) != declared
    assert OuterStep.declared_digest_of({"optimizer": {}}) == ""
    assert _outer(lr=0.5).declared_digest(tensors_digest(outer.global_params)) != declared
