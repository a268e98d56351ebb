"""A site: several local ranks (one torchrun group, e.g. the GPUs of one node) acting as one worker.

    torchrun --nproc-per-node 8 -m diloco.cli train CONFIG worker.site=true worker.index=I ...
    SITE=I NPROC=8 bash launch/site.sh CONFIG ...                   # the same, with defaults

Inside the site the ranks train one replica data-parallel, as DDP does: each rank takes its
slice of the site's batch (``inner.batch_size`` sequences a rank, drawn from the site's shard as
one batch of ``inner.batch_size x ranks``) and the gradients are averaged over the site's fast
links (gloo on CPU, NCCL on GPU) inside every inner step, before clipping and the update, so
every rank holds the same params.

Across sites only rank 0, the leader, talks to the other sites (``SiteBackend``): it averages
the pseudo-gradient over the run's transport (hivemind) and broadcasts what the transport
returned (the averaged tensors, the result, any state downloaded from a peer) to the other
ranks, which then take the very same outer step. Traffic is reduced inside the site first and
only then sent across sites, never the reverse; the site counts as one worker of the run.

Each rank writes its own records (rank 0 into the run directory, rank r into ``rank-<r>/``), so
that every rank's global params can be checked against the others'. Sharded models (FSDP, each
rank syncing its own shard across sites) are not supported yet.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from diloco.comm.base import CommBackend, PeerState, StateRank, SyncResult
from diloco.config import ConfigError


class Site:
    """This process's place in its site: rank, number of ranks, and the site's process group."""

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank, self.size, self.device = rank, size, device

    @classmethod
    def from_torchrun(cls, device: torch.device, timeout_s: float) -> Site:
        """Join the site's process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_*)."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ConfigError("worker.site=true runs under torchrun (it sets RANK and WORLD_SIZE): see launch/site.sh")
        if not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )
        return cls(dist.get_rank(), dist.get_world_size(), device)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def my_slice(self, batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's rows of a batch drawn for the whole site."""
        rows = batch[0].shape[0] // self.size
        return [t[self.rank * rows : (self.rank + 1) * rows] for t in batch]

    def gradient_averaging(self, model: nn.Module) -> Callable[[], None]:
        """A hook for ``inner_step``: average the gradients over the site's ranks (one flat all-reduce)."""

        def mean_over_ranks(flat: torch.Tensor) -> None:
            dist.all_reduce(flat)
            flat.div_(self.size)

        return lambda: self._collective([p.grad for p in model.parameters() if p.grad is not None], mean_over_ranks)

    def share(self, value):
        """The leader's ``value`` (any picklable object), on every rank."""
        box = [value if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite ``tensors`` on every rank with the leader's."""
        self._collective(tensors, lambda flat: dist.broadcast(flat, src=0))

    @torch.no_grad()
    def _collective(self, tensors: Sequence[torch.Tensor], operation: Callable[[torch.Tensor], None]) -> None:
        """Run ``operation`` on all of ``tensors`` as one flat buffer on the site's device (one
        collective instead of one per tensor), then write the result back into them."""
        flat = torch.cat([t.reshape(-1) for t in tensors]).to(self.device)
        operation(flat)
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class SiteBackend(CommBackend):
    """The run's transport as seen by every rank of a site: the leader uses ``transport`` (the
    other ranks have none) and shares each answer with the site, so every rank takes the same
    decisions at the same points. Rounds block (no overlap): the site's collectives must not
    interleave with the gradient averaging of inner steps."""

    def __init__(self, site: Site, transport: CommBackend | None):
        self.site, self.transport = site, transport

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        result = None
        if self.site.leader:
            result = self.transport.all_reduce_mean(
                tensors, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
            )
        result = self.site.share(result)
        self.site.share_tensors(tensors)  # the average; on failure the leader's own pseudo-gradient, as ours
        return result

    def publish_state(self, round_index: int, rank: StateRank, state: Callable[[], dict]) -> None:
        if self.site.leader:
            self.transport.publish_state(round_index, rank, state)

    def fetch_state(
        self, round_index: int, *, better_than: StateRank, timeout_s: float, newer: bool = False
    ) -> PeerState | None:
        found = None
        if self.site.leader:
            found = self.transport.fetch_state(round_index, better_than=better_than, timeout_s=timeout_s, newer=newer)
        return self.site.share(found)

    def expected_peers(self) -> int | None:
        return self.site.share(self.transport.expected_peers() if self.site.leader else None)

    def report_progress(self, round_index: int, step: int, stats: dict | None = None) -> None:
        if self.site.leader:
            self.transport.report_progress(round_index, step, stats)

    def live_workers(self) -> dict:
        return self.site.share(self.transport.live_workers() if self.site.leader else None)

    def leave(self) -> None:
        if self.site.leader:
            self.transport.leave()

    def finish(self) -> None:
        if self.site.leader:
            self.transport.finish()

    @property
    def addresses(self) -> list[str]:
        return self.transport.addresses if self.site.leader else []

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.shutdown()
        self.site.close()
