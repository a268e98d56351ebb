"""A site's transport: several local ranks (one torchrun group, e.g. the GPUs of one node) acting as
one worker of the run, and the site's own group (``Site``) they share answers and tensors over.

    torchrun --nproc-per-node 8 -m diloco.cli train CONFIG worker.site=true worker.index=I ...
    SITE=I NPROC=8 bash launch/site.sh CONFIG ...                   # the same, with defaults
    SITE=I NPROC=8 SHARDING=fsdp bash launch/site.sh CONFIG ...     # a model too big for one device

Inside the site the ranks train one replica data-parallel: each rank takes its slice of the
site's batch (``inner.batch_size`` sequences a rank, drawn from the site's shard as one batch of
``inner.batch_size x ranks``) and the gradients are averaged over the site's fast links (gloo on
CPU, NCCL on GPU) inside every inner step, before clipping and the update. How the params are
held there is ``worker.site_sharding``:

- ``ddp`` (the default): every rank holds all the params and averages the gradients in one flat
  all-reduce. Across sites only rank 0, the leader, talks to the other sites (``SiteBackend``):
  it averages the pseudo-gradient over the run's transport (hivemind) and broadcasts what the
  transport returned (the averaged tensors, the result, any state downloaded from a peer) to
  the other ranks, which then take the very same outer step.
- ``fsdp``: the model is sharded with FSDP2 (``fully_shard``, ``shard_model`` in
  worker/placement.py), so each rank holds 1/ranks of every param (and of the inner optimizer's
  state), gathers a block's params just before using them and reduce-scatters the gradients in
  backward; gradient clipping takes the norm over all the shards. Each rank's outer step holds
  the global copy of its own shards only, and every rank averages its shard's pseudo-gradient
  with the ranks that hold the same shard in the other sites, over a transport of its own
  (``sharded_site_transport``, under the run id ``<comm.run_id>_shard<r>of<ranks>``): all the
  site's links carry traffic at once. Every site must then have the same number of ranks (sites
  of other sizes never meet). The ranks agree on each answer (a round is ok only when every
  shard's was), so that they take the same decisions. Not supported with fsdp: resuming from a
  checkpoint, ``diloco join``, and the run's roster under ``comm.run_id`` (``diloco status``
  sees each shard's roster, under its own run id, instead).

Either way, traffic is reduced inside the site first and only then sent across sites, never
the reverse; the site counts as one worker of the run.

Each rank writes its own records (rank 0 into the run directory, rank r into ``rank-<r>/``), so
that every rank's global params can be checked against the others' (with fsdp, the hash in a
rank's records and its checkpoint's global params are those of its shard).
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from diloco.comm.base import (
    Averaging,
    CommBackend,
    Membership,
    PeerState,
    StateCheck,
    StateExchange,
    StateRank,
    StateReader,
    SyncResult,
    fingerprint_of,
)
from diloco.comm.config import CommConfig
from diloco.comm.members import LiveWorker
from diloco.comm.round_result import agreed_outcome
from diloco.errors import ConfigError


class Site:
    """This process's place in its site: rank, number of ranks, and the site's process group."""

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank, self.size, self.device = rank, size, device

    @classmethod
    def from_torchrun(cls, device: torch.device, timeout_s: float) -> Site:
        """Join the site's process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_*)."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ConfigError("worker.site=true runs under torchrun (it sets RANK and WORLD_SIZE): see launch/site.sh")
        if device.type == "cuda":  # one GPU a rank (NCCL refuses two ranks on one device)
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )
        return cls(dist.get_rank(), dist.get_world_size(), device)

    @property
    def leader(self) -> bool:
        return self.rank == 0

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

    def gather(self, value) -> list:
        """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
        values = [None] * self.size
        dist.all_gather_object(values, value)
        return values

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


def shard_comm(cfg: CommConfig, site: Site) -> CommConfig:
    """The transport settings of this rank's shard: a run id of its own (so that only the ranks
    holding the same shard in other sites group together; the site's size is in it, so sites of
    other sizes never meet), and with a fixed ``comm.hivemind.port`` the rank's own port beside it."""
    port = cfg.hivemind.port + site.rank if cfg.hivemind.port else 0
    return replace(cfg, run_id=f"{cfg.run_id}_shard{site.rank}of{site.size}", hivemind=replace(cfg.hivemind, port=port))


class SiteAveraging(Averaging):
    """The leader averages over ``inner`` (the other ranks have none) and shares the result and the
    mean with the site. Rounds block (no overlap): the site's collectives must not interleave with
    the gradient averaging of inner steps."""

    def __init__(self, site: Site, inner: Averaging | None):
        self.site, self.inner = site, inner

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        result = None
        if self.site.leader:
            result = self.inner.all_reduce_mean(
                tensors, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
            )
        result = self.site.share(result)
        self.site.share_tensors(tensors)  # the average; on failure the leader's own pseudo-gradient, as ours
        return result


class SiteStates(StateExchange):
    """The leader offers and fetches states over ``own`` (its transport's; on the other ranks, which
    have none, the do-nothing ``StateExchange``) and shares what it found with the site."""

    def __init__(self, site: Site, own: StateExchange):
        self.site, self.own = site, own

    def publish_state(self, round_index: int, rank: StateRank, state: StateReader) -> None:
        self.own.publish_state(round_index, rank, state)

    def fetch_state(
        self,
        round_index: int,
        *,
        better_than: StateRank,
        timeout_s: float,
        newer: bool = False,
        check: StateCheck | None = None,
    ) -> PeerState | None:
        found = None
        if self.site.leader:
            found = self.own.fetch_state(
                round_index, better_than=better_than, timeout_s=timeout_s, newer=newer, check=check
            )
        return self.site.share(found)

    def sole_state_source(self) -> bool:
        return self.site.share(self.own.sole_state_source() if self.site.leader else None)


class SiteMembership(Membership):
    """What the run looks like (how many workers to expect, who is live) is the leader's answer,
    shared with the site; what a rank tells the run goes over ``own``, its transport's membership
    (the do-nothing ``Membership`` on a rank without a transport)."""

    def __init__(self, site: Site, own: Membership):
        self.site, self.own = site, own

    def expected_peers(self) -> int | None:
        return self.site.share(self.own.expected_peers() if self.site.leader else None)

    def declare_params(self, rounds_done: int, digest: str, *, peers: int) -> None:
        self.own.declare_params(rounds_done, digest, peers=peers)

    def live_workers(self) -> dict[int, LiveWorker]:
        return self.site.share(self.own.live_workers() if self.site.leader else None)

    def report_progress(self, round_index: int, step: int, stats: dict | None = None) -> None:
        self.own.report_progress(round_index, step, stats)

    def report_phase(self, phase: str, since: float) -> None:
        self.own.report_phase(phase, since)

    def announce_run(self, identity: dict) -> None:
        self.own.announce_run(identity)

    def leave(self) -> None:
        self.own.leave()

    @property
    def addresses(self) -> list[str]:
        return self.own.addresses


class SiteBackend(CommBackend):
    """The run's transport as seen by every rank of a site: the leader uses ``transport`` (the
    other ranks have none) and shares each answer with the site, so every rank takes the same
    decisions at the same points. Its end ends the transport and the site's group."""

    def __init__(self, site: Site, transport: CommBackend | None):
        self.site, self.transport = site, transport
        super().__init__(
            SiteAveraging(site, transport.averaging if transport is not None else None),
            states=SiteStates(site, transport.states if transport is not None else StateExchange()),
            membership=SiteMembership(site, transport.membership if transport is not None else Membership()),
        )

    def finish(self) -> None:
        if self.transport is not None:
            self.transport.finish()

    def shutdown(self) -> None:
        if self.transport is not None:
            self.transport.shutdown()
        self.site.close()


def sharded_site_transport(site: Site, transport: CommBackend) -> CommBackend:
    """A sharded site's transports (``worker.site_sharding=fsdp``): every rank has its own
    (``shard_comm``) and averages and exchanges states over it (``ShardedSiteAveraging``,
    ``ShardedSiteStates``); the roster's answers (who is alive) are the leader's shard's, as on
    any site, and its end is a site's."""
    return SiteBackend(site, transport).with_parts(
        averaging=ShardedSiteAveraging(site, transport.averaging), states=ShardedSiteStates(site, transport.states)
    )


class ShardedSiteAveraging(Averaging):
    """Every rank averages its own shard over ``inner``, its shard's transport, with the ranks that
    hold the same shard in the other sites, all at once; then the ranks agree on what happened: a
    round is ok only when every shard's was, over the fewest peers any shard had."""

    def __init__(self, site: Site, inner: Averaging):
        self.site, self.inner = site, inner

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        result = self.inner.all_reduce_mean(
            tensors, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
        )
        results = self.site.gather(result)
        return replace(
            result,  # this rank's traffic, for its records
            # every shard whole: ours; every shard its group's common mean, some partial: partial
            outcome=agreed_outcome(result.outcome, [r.outcome for r in results]),
            peers=min(r.peers for r in results),
            group=min(r.group for r in results),
            error=next((r.error for r in results if r.error), ""),
        )


class ShardedSiteStates(StateExchange):
    """Every rank offers and fetches its shard's state over ``inner``; a peer's state is taken only
    when every shard found the state of one site (one round, one site rank: ``site_rank``)."""

    def __init__(self, site: Site, inner: StateExchange | None):
        self.site, self.inner = site, inner

    def publish_state(self, round_index: int, rank: StateRank, state: StateReader) -> None:
        self.inner.publish_state(round_index, self.site_rank(rank), state)

    def fetch_state(
        self,
        round_index: int,
        *,
        better_than: StateRank,
        timeout_s: float,
        newer: bool = False,
        check: StateCheck | None = None,
    ) -> PeerState | None:
        # a shard's params are not the declared ones (a sharded site declares none): nothing to check
        better_than = self.site_rank(better_than)
        found = self.inner.fetch_state(round_index, better_than=better_than, timeout_s=timeout_s, newer=newer)
        # every shard must have taken the state of one site: one round, one site rank (its fingerprint)
        taken = set(self.site.gather(None if found is None else (found.round, found.rank)))
        return found if None not in taken and len(taken) == 1 else None

    def sole_state_source(self) -> bool:
        return all(self.site.gather(self.inner.sole_state_source()))

    def site_rank(self, rank: StateRank) -> StateRank:
        """``rank`` with one fingerprint for the whole site, made from every shard's. Between groups
        of one size the larger fingerprint wins (``StateRank``); a shard's own fingerprint could make
        one group win for shard 0 and the other for shard 1, and then no site would take every
        shard's state. With the site's, every shard picks the same winner."""
        fingerprints = self.site.gather(rank.fingerprint)
        if len(set(fingerprints)) == 1:  # none taken (a round everyone averaged in), or already the site's
            return rank
        digest = hashlib.sha256(repr(fingerprints).encode()).digest()
        return replace(rank, fingerprint=fingerprint_of(digest))
