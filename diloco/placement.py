"""Where a worker's model lives, and which of its processes talks to the run.

``placement_for`` picks one of three from ``worker.site`` and ``worker.site_sharding``:

- ``SingleProcess`` (the default): one process holds the whole model and talks to the run;
- ``ReplicatedSite``: the ranks of a site (site.py) each hold the whole model, average their
  gradients inside every inner step, and only the leader talks to the run (``SiteBackend``);
- ``ShardedSite``: each rank holds a shard of the model (FSDP2) and syncs it with the same shard
  of the other sites, over a transport of its own (``ShardedSiteBackend``).

``train()`` asks its placement what to do at each of these points, never which one it has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from diloco.comm.base import CommBackend, CommConfig
from diloco.config import ConfigError, WorkerConfig
from diloco.data import evaluate, evaluate_cached
from diloco.site import ShardedSiteBackend, Site, SiteBackend, local_shards, shard_comm, shard_model

Batch = Sequence[torch.Tensor]


class SingleProcess:
    """One process, the whole model, its own transport."""

    ranks = 1
    leader = True  # writes the run's records (and wandb)

    def __init__(self, device: torch.device):
        self.device = device

    def run_dir(self, run_dir: Path) -> Path:
        """Where this process writes its records and checkpoints."""
        return run_dir

    def check_join(self, join: bool) -> None:
        """Refuse ``diloco join`` where it is not supported."""

    def check_resume(self, checkpoints: Path) -> None:
        """Refuse resuming from ``checkpoints`` where it is not supported."""

    def place(self, model: nn.Module) -> list[torch.Tensor]:
        """Move ``model`` where it trains; return the params this process's outer step averages."""
        return list(model.to(self.device).parameters())

    def my_slice(self, batch: Batch) -> Batch:
        """This process's rows of a batch drawn for ``ranks`` processes."""
        return batch

    def transport_comm(self, comm: CommConfig) -> CommConfig | None:
        """The settings of this process's transport to the run; None when it has none."""
        return comm

    def backend(self, transport: CommBackend | None) -> CommBackend:
        """What the outer step talks to, given this process's transport."""
        return transport

    def gradient_averaging(self, model: nn.Module, data_parallel: Callable[[], None] | None):
        """The hook ``inner_step`` calls between backward and the update (``data_parallel``: the
        data-parallel baseline's, or None)."""
        return data_parallel

    def checkpoint_state(self, state: dict) -> dict:
        """What of ``state`` this process checkpoints."""
        return state

    def evaluate(self, model: nn.Module, held_out: list, params_key: tuple[str, str]) -> float:
        """Validation loss; simulated workers holding the same params (``params_key``) share one."""
        return evaluate_cached(model, held_out, params_key)


class ReplicatedSite(SingleProcess):
    """A rank of a site whose ranks each hold the whole model (``worker.site_sharding=ddp``)."""

    def __init__(self, site: Site):
        super().__init__(site.device)
        self.site = site
        self.ranks, self.leader = site.size, site.leader

    def run_dir(self, run_dir: Path) -> Path:
        return run_dir if self.leader else run_dir / f"rank-{self.site.rank}"

    def my_slice(self, batch: Batch) -> Batch:
        return self.site.my_slice(batch)

    def transport_comm(self, comm: CommConfig) -> CommConfig | None:
        return comm if self.leader else None  # only the leader talks to the other sites

    def backend(self, transport: CommBackend | None) -> CommBackend:
        return SiteBackend(self.site, transport)

    def gradient_averaging(self, model: nn.Module, data_parallel: Callable[[], None] | None):
        return self.site.gradient_averaging(model)


class ShardedSite(ReplicatedSite):
    """A rank of a site whose ranks each hold a shard of the model (``worker.site_sharding=fsdp``)."""

    def check_join(self, join: bool) -> None:
        if join:
            raise ConfigError("a sharded site (worker.site_sharding=fsdp) cannot join a live run with diloco join yet")

    def check_resume(self, checkpoints: Path) -> None:
        raise ConfigError(f"a sharded site cannot resume from {checkpoints} yet: start afresh in another run.dir")

    def place(self, model: nn.Module) -> list[torch.Tensor]:
        # built in host memory, the model moves to the device block by block as it is sharded,
        # so it never has to fit there whole
        return shard_model(model, self.site)

    def transport_comm(self, comm: CommConfig) -> CommConfig | None:
        return shard_comm(comm, self.site)  # every rank syncs its own shard

    def backend(self, transport: CommBackend | None) -> CommBackend:
        return ShardedSiteBackend(self.site, transport)

    def gradient_averaging(self, model: nn.Module, data_parallel: Callable[[], None] | None):
        return None  # FSDP reduce-scatters the gradients inside backward

    def checkpoint_state(self, state: dict) -> dict:
        return local_shards(state)  # each rank saves its own shards, as plain tensors

    def evaluate(self, model: nn.Module, held_out: list, params_key: tuple[str, str]) -> float:
        # the ranks evaluate together (FSDP gathers the params inside forward): never from a cache
        return evaluate(model, held_out)


def placement_for(cfg: WorkerConfig, device: torch.device, *, site_timeout_s: float) -> SingleProcess:
    """This process's placement. A site's collectives wait up to ``site_timeout_s`` for its slowest rank."""
    if not cfg.site:
        return SingleProcess(device)
    site = Site.from_torchrun(device, timeout_s=site_timeout_s)
    return ShardedSite(site) if cfg.site_sharding == "fsdp" else ReplicatedSite(site)
