"""What each placement tells the worker loop (logic only: a site here is a rank number and a size,
without a process group; tests/integration/test_site.py runs real torchrun sites)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from diloco.comm.base import Averaging, CommBackend
from diloco.comm.config import CommConfig
from diloco.comm.hivemind.settings import HivemindConfig
from diloco.comm.sites import ShardedSiteAveraging, ShardedSiteStates, Site, SiteAveraging, SiteBackend
from diloco.config import ConfigError
from diloco.worker.placement import ReplicatedSite, ShardedSite, SingleProcess

CPU = torch.device("cpu")


class _Alone(Averaging):
    def all_reduce_mean(self, tensors, weight, *, round_index, deadline_s, fragment=0):
        raise AssertionError("the placements only pass the transport on")


def _opened() -> tuple[list[CommConfig], Callable]:
    opened: list[CommConfig] = []

    def open_transport(comm: CommConfig):
        opened.append(comm)
        return CommBackend(_Alone())  # a stand-in transport: the placements only pass it on

    return opened, open_transport


def test_one_process_opens_its_own_transport_and_has_no_site_hook():
    placement, (opened, open_transport) = SingleProcess(CPU), _opened()
    comm = CommConfig(run_id="r")
    backend = placement.connect(comm, open_transport)
    assert opened == [comm] and backend is not None
    assert placement.site_gradient_hook(torch.nn.Linear(2, 2)) is None
    assert placement.run_dir(Path("run")) == Path("run") and (placement.ranks, placement.leader) == (1, True)
    placement.check_join()  # supported: no error
    placement.check_resume(Path("run/checkpoints"))


@pytest.mark.parametrize("rank", [0, 1])
def test_of_a_replicated_site_only_the_leader_opens_a_transport(rank):
    placement, (opened, open_transport) = ReplicatedSite(Site(rank, 2, CPU)), _opened()
    backend = placement.connect(CommConfig(run_id="r"), open_transport)
    assert isinstance(backend, SiteBackend) and isinstance(backend.averaging, SiteAveraging)
    assert [c.run_id for c in opened] == (["r"] if rank == 0 else [])
    assert (backend.transport is None) == (rank != 0)
    assert placement.run_dir(Path("run")) == (Path("run") if rank == 0 else Path("run/rank-1"))
    assert placement.site_gradient_hook(torch.nn.Linear(2, 2)) is not None  # averages over the site's ranks
    rows = placement.my_slice([torch.arange(4), torch.arange(4) + 10])
    assert [t.tolist() for t in rows] == ([[0, 1], [10, 11]] if rank == 0 else [[2, 3], [12, 13]])


def test_every_rank_of_a_sharded_site_opens_its_shards_transport_and_refuses_join_and_resume():
    placement, (opened, open_transport) = ShardedSite(Site(1, 2, CPU)), _opened()
    backend = placement.connect(CommConfig(run_id="r", hivemind=HivemindConfig(port=4000)), open_transport)
    assert isinstance(backend.averaging, ShardedSiteAveraging) and isinstance(backend.states, ShardedSiteStates)
    assert [(c.run_id, c.hivemind.port) for c in opened] == [("r_shard1of2", 4001)]
    assert placement.site_gradient_hook(torch.nn.Linear(2, 2)) is None  # FSDP reduce-scatters in backward
    with pytest.raises(ConfigError, match="cannot join a live run"):
        placement.check_join()
    with pytest.raises(ConfigError, match="cannot resume from"):
        placement.check_resume(Path("run/checkpoints"))
