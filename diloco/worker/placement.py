"""Where a worker's model lives, and which of its processes talks to the run.

``placement_for`` picks one of three from ``worker.site`` and ``worker.site_sharding``:

- ``SingleProcess`` (the default): one process holds the whole model and talks to the run;
- ``ReplicatedSite``: the ranks of a site (comm/sites.py) each hold the whole model, average their
  gradients inside every inner step, and only the leader talks to the run (``SiteBackend``);
- ``ShardedSite``: each rank holds a shard of the model (FSDP2) and syncs it with the same shard
  of the other sites, over a transport of its own (``sharded_site_transport``); the model is
  sharded here (``shard_model``).

``train()`` asks its placement at each point where they differ, never which one it has: where
to write records, whether joining or resuming is supported, how to place the model (and what
the outer step averages), which rows of a batch to train on, how to reach the run, the
gradient hook inside the inner step, what to checkpoint, and how to evaluate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from diloco.comm.base import CommBackend
from diloco.comm.config import CommConfig
from diloco.comm.sites import Site, SiteBackend, shard_comm, sharded_site_transport
from diloco.config import ConfigError, WorkerConfig
from diloco.core.evaluation import evaluate, evaluate_cached

Batch = Sequence[torch.Tensor]
OpenTransport = Callable[[CommConfig], CommBackend]


class Placement:
    """What ``train()`` asks; the defaults are those of one process holding the whole model."""

    ranks = 1  # processes that train this worker's replica together
    rank = 0  # this process's place among them
    leader = True  # writes its records into the run directory (other ranks into rank-<r>/), and to wandb

    def __init__(self, device: torch.device):
        self.device = device

    def run_dir(self, run_dir: Path) -> Path:
        """Where this process writes its records and checkpoints."""
        return run_dir

    def check_join(self) -> None:
        """Refuse ``diloco join`` where it is not supported (ConfigError)."""

    def check_resume(self, checkpoints: Path) -> None:
        """Refuse resuming from ``checkpoints`` where it is not supported (ConfigError)."""

    def place(self, model: nn.Module) -> list[torch.Tensor]:
        """Move ``model`` where it trains; return the params this process's outer step averages."""
        return list(model.to(self.device).parameters())

    def my_slice(self, batch: Batch) -> Batch:
        """This process's rows of a batch drawn for ``ranks`` processes."""
        return batch

    def connect(self, comm: CommConfig, open_transport: OpenTransport) -> CommBackend:
        """What the outer step talks to: a transport opened with ``open_transport`` (or none), wrapped."""
        return open_transport(comm)

    def site_gradient_hook(self, model: nn.Module) -> Callable[[], None] | None:
        """A hook for ``inner_step`` that averages gradients over the site's ranks, if any."""
        return None

    def checkpoint_state(self, state: dict) -> dict:
        """What of ``state`` this process checkpoints."""
        return state

    def evaluate(self, model: nn.Module, held_out: list, params_key: tuple[str, str] | None) -> float:
        """Validation loss; workers simulated in this process with the same ``params_key`` (the
        hash of the model's params, of the held-out set) share one; None: evaluate afresh."""
        return evaluate(model, held_out) if params_key is None else evaluate_cached(model, held_out, params_key)


class SingleProcess(Placement):
    """One process, the whole model, its own transport."""


class _SiteRank(Placement):
    """One rank of a site: a share of its batch, records of its own beside the leader's."""

    def __init__(self, site: Site):
        super().__init__(site.device)
        self.site = site
        self.ranks, self.rank, self.leader = site.size, site.rank, site.leader

    def run_dir(self, run_dir: Path) -> Path:
        return run_dir if self.leader else run_dir / f"rank-{self.site.rank}"

    def my_slice(self, batch: Batch) -> Batch:
        rows = batch[0].shape[0] // self.site.size
        return [t[self.site.rank * rows : (self.site.rank + 1) * rows] for t in batch]


class ReplicatedSite(_SiteRank):
    """A rank of a site whose ranks each hold the whole model (``worker.site_sharding=ddp``)."""

    def connect(self, comm: CommConfig, open_transport: OpenTransport) -> CommBackend:
        # only the leader talks to the other sites; it shares each answer with the site's ranks
        return SiteBackend(self.site, open_transport(comm) if self.leader else None)

    def site_gradient_hook(self, model: nn.Module) -> Callable[[], None] | None:
        return self.site.gradient_averaging(model)


class ShardedSite(_SiteRank):
    """A rank of a site whose ranks each hold a shard of the model (``worker.site_sharding=fsdp``).
    Its gradients are reduce-scattered by FSDP inside backward: no gradient hook."""

    def check_join(self) -> None:
        raise ConfigError("a sharded site (worker.site_sharding=fsdp) cannot join a live run with diloco join yet")

    def check_resume(self, checkpoints: Path) -> None:
        raise ConfigError(f"a sharded site cannot resume from {checkpoints} yet: start afresh in another run.dir")

    def place(self, model: nn.Module) -> list[torch.Tensor]:
        # built in host memory, the model moves to the device block by block as it is sharded,
        # so it never has to fit there whole; the outer step averages this rank's shards
        return shard_model(model, self.site)

    def connect(self, comm: CommConfig, open_transport: OpenTransport) -> CommBackend:
        # every rank syncs its own shard, with the same shard of the other sites
        return sharded_site_transport(self.site, open_transport(shard_comm(comm, self.site)))

    def checkpoint_state(self, state: dict) -> dict:
        return local_shards(state)  # each rank saves its own shards, as plain tensors

    def evaluate(self, model: nn.Module, held_out: list, params_key: tuple[str, str] | None) -> float:
        # the ranks evaluate together (FSDP gathers the params inside forward): never from a cache
        return evaluate(model, held_out)


def shard_model(model: nn.Module, site: Site) -> list[torch.Tensor]:
    """Shard ``model`` over the site's ranks with FSDP2 (``fully_shard``): every block of each
    ``nn.ModuleList`` (a transformer's layers) is a unit of its own, gathered just before its
    forward and freed after it, and the root holds the rest (embeddings, the tied head, the
    final norm); each is moved to the site's device as it is sharded, so a model built in host
    memory never has to fit on the device whole. Returns this rank's shards of the params
    (views: writing into one writes the param), leaving out the empty ones (a param with fewer
    rows than the site has ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(site.device.type, (site.size,))
    blocks = [block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module]
    for block in reversed(blocks):  # inner blocks before the blocks that hold them
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():  # views without autograd history, for the outer step to read and write
        shards = [param.to_local() for param in model.parameters()]
    return [shard for shard in shards if shard.numel()]


def local_shards(state):
    """``state`` (nested dicts, lists and tensors) with each DTensor replaced by this rank's shard
    of it: what a rank of a sharded site checkpoints (its model and inner optimizer state)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {key: local_shards(value) for key, value in state.items()}
    if isinstance(state, list):
        return [local_shards(value) for value in state]
    return state


def placement_for(cfg: WorkerConfig, device: torch.device, *, site_timeout_s: float) -> Placement:
    """This process's placement. A site's collectives wait up to ``site_timeout_s`` for its slowest rank."""
    if not cfg.site:
        return SingleProcess(device)
    site = Site.from_torchrun(device, timeout_s=site_timeout_s)
    return ShardedSite(site) if cfg.site_sharding == "fsdp" else ReplicatedSite(site)
