"""A site: several torchrun ranks acting as one worker (diloco/comm/sites.py). Two sites of two ranks
each (gloo inside, hivemind across, real processes) hold identical global params on all four
ranks after every round, equal to two single-rank workers with the same global batch; sharded
with FSDP2, rank r of each site holds the same shard, and the shards gathered equal those params."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest
import torch

from diloco.config import load_config
from diloco.lifetime import stop_all
from diloco.tools.launcher import simulate, start_bootstrap
from diloco.worker.checkpoint import read_checkpoint
from tests.conftest import TINY, read_records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
COMMON = [*TINY, "inner.steps=20", "outer.sync_every=10", "checkpoint.every_rounds=1", "checkpoint.keep=5"]


def _global_params(run_dir, worker: int, round_index: int) -> list[torch.Tensor]:
    state = read_checkpoint(run_dir / "checkpoints" / f"worker-{worker}" / f"round-{round_index:06d}.pt")
    return state["outer"]["global_params"]


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.flatten() for p in params])


def _run_sites(run_dir, peer: str, extra: list[str]) -> list[subprocess.Popen]:
    sites = []
    for index in range(2):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "diloco.cli", "train", *COMMON, "worker.site=true", f"worker.index={index}", "worker.count=2",
            "worker.threads=1", f"run.dir={run_dir}", f"comm.hivemind.initial_peers=['{peer}']", *extra,
        ]  # fmt: skip
        log = (run_dir.parent / f"site-{index}.log").open("wb")
        sites.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return sites


def _train_two_sites_once(folder, *extra: str):
    """Two sites of two ranks each, through a bootstrap peer; returns the run directory."""
    run_dir = folder / "sites"
    run_dir.mkdir(parents=True)
    bootstrap, peers = start_bootstrap(host="127.0.0.1", timeout_s=60, log=run_dir / "bootstrap.log")
    sites = []
    try:
        sites = _run_sites(run_dir, peers[0], list(extra))
        codes = [site.wait(timeout=240) for site in sites]
    finally:
        for site in sites:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(site.pid, signal.SIGKILL)
        stop_all([bootstrap])
    logs = "".join((folder / f"site-{i}.log").read_text()[-3000:] for i in range(2))
    assert codes == [0, 0], logs
    return run_dir


def _train_two_sites(tmp_path, *extra: str):
    """``_train_two_sites_once``, run once more if a round was not averaged by both sites. With
    4 ranks and 8 hivemind processes on 2 cores, hivemind's matchmaking about once in 20 runs puts
    a peer in a leader's group that never joins it (in the failed run's log, the leader waited
    22 s for parts that never came, and the other peer found no group before the deadline). The
    run recovers by a state download and every round's params still agree (asserted on the run
    set aside), but the comparison with single-rank workers needs every round averaged by both."""
    run_dir = _train_two_sites_once(tmp_path / "first", *extra)
    if _every_round_averaged_by_both(run_dir):
        return run_dir
    _assert_same_params_by_round(run_dir)  # the recovered run agrees too
    return _train_two_sites_once(tmp_path / "second", *extra)


def _every_round_averaged_by_both(run_dir) -> bool:
    """Whether every rank's record of every round says both sites averaged it."""
    return all(
        record["peers"] == 2
        for folder in (run_dir, run_dir / "rank-1")
        for worker in (0, 1)
        for record in read_records(folder, worker)
        if record["event"] == "round"
    )


def _hashes_by_round(records_of: list[tuple], *, averaged_by_both: bool = True) -> dict[int, set[str]]:
    """The param hashes each round's records hold, over the (folder, worker) pairs given."""
    by_round: dict[int, set[str]] = {}
    for folder, worker in records_of:
        for record in read_records(folder, worker):
            if record["event"] == "round":
                if averaged_by_both:
                    assert record["peers"] == 2, record  # the two sites, each one worker
                by_round.setdefault(record["round"], set()).add(record["param_sha256"])
    return by_round


def _assert_same_params_by_round(run_dir) -> None:
    """Rank r of both sites holds the same params (with fsdp: the same shard) after every round."""
    for folder in (run_dir, run_dir / "rank-1"):
        by_round = _hashes_by_round([(folder, 0), (folder, 1)], averaged_by_both=False)
        assert sorted(by_round) == [1, 2] and all(len(hashes) == 1 for hashes in by_round.values()), by_round


@pytest.fixture(scope="module")
def single_rank_params(tmp_path_factory) -> torch.Tensor:
    """The global params after round 1 of two single-rank workers, each with a site's batch (2 ranks
    x 8 sequences), on the simulator (which agrees with hivemind to 1e-5: test_simulator.py), in
    this process; both site tests compare with it."""
    reference = tmp_path_factory.mktemp("reference")
    cfg = load_config(None, [*COMMON, "inner.batch_size=16", "comm.backend=simulator", f"run.dir={reference}"])
    simulate(cfg, workers=2)
    return _flat(_global_params(reference, 0, 1))


def _assert_close(site_params: torch.Tensor, single_params: torch.Tensor) -> None:
    difference = ((site_params - single_params).norm() / single_params.norm()).item()
    assert difference < 1e-5, difference


def test_two_sites_of_two_ranks_agree_on_every_rank_and_match_single_rank_workers(tmp_path, single_rank_params):
    run_dir = _train_two_sites(tmp_path)

    # every rank of every site: one hash of the global params per round
    by_round = _hashes_by_round([(run_dir, 0), (run_dir, 1), (run_dir / "rank-1", 0), (run_dir / "rank-1", 1)])
    assert sorted(by_round) == [1, 2] and all(len(hashes) == 1 for hashes in by_round.values()), by_round

    _assert_close(_flat(_global_params(run_dir, 0, 1)), single_rank_params)


def test_two_sharded_sites_hold_the_same_shards_and_gathered_match_single_rank_workers(tmp_path, single_rank_params):
    run_dir = _train_two_sites(tmp_path, "worker.site_sharding=fsdp")
    rank_dirs = [run_dir, run_dir / "rank-1"]

    # rank r of both sites: one hash of its shard per round; the two shards differ
    shard_hashes = [_hashes_by_round([(folder, 0), (folder, 1)]) for folder in rank_dirs]
    for by_round in shard_hashes:
        assert sorted(by_round) == [1, 2] and all(len(hashes) == 1 for hashes in by_round.values()), by_round
    assert shard_hashes[0][1] != shard_hashes[1][1]

    # site 1's shards, gathered (FSDP2 cuts every param into row blocks, rank 0's first)
    shards = [_global_params(folder, 1, 1) for folder in rank_dirs]
    gathered = [torch.cat(rows) for rows in zip(*shards, strict=True)]
    _assert_close(_flat(gathered), single_rank_params)
