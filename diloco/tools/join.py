"""``diloco join``'s way into a live run: the run's live workers from its roster, a free slot
(a data shard no live worker holds), the run's plan, and the run's own config from a live peer when
the volunteer brings none. The command line parses and dispatches; the worker it then starts is
``diloco train``'s (``worker/train.py``), which takes the run's state first (``worker/joining.py``);
under ``diloco launch --join`` it is the user's script (``launch.py``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from diloco.comm.hivemind.peer import probe_roster
from diloco.comm.hivemind.roster import free_slot
from diloco.comm.members import nobody_answered
from diloco.config import Config, load_config
from diloco.errors import UsageError
from diloco.worker.joining import JoinError, config_digest, config_from_run
from diloco.worker.train import run_worker


@dataclass(frozen=True)
class Place:
    """Where a volunteer joins: its slot, the run's plan, and the live workers' roster entries."""

    slot: int
    planned: int  # worker.count the run was planned with
    slots: int  # worker.slots: the run's data shards
    entries: dict

    @property
    def overrides(self) -> list[str]:
        return [f"worker.count={self.planned}", f"worker.slots={self.slots}", f"worker.index={self.slot}"]


def choose_slot(cfg: Config) -> Place:
    """A free slot of the live run ``cfg.comm`` names; ``JoinError`` when nobody answers,
    ``UsageError`` when every shard is held."""
    hm = cfg.comm.hivemind
    entries = {i: e for i, e in probe_roster(cfg.comm, timeout_s=hm.matchmaking_s).items() if not e.leaving}
    if not entries:
        raise JoinError(nobody_answered(cfg.comm.run_id, hm.initial_peers, hm.matchmaking_s))
    # the run's plan and slots are the run's, whatever the joiner's own file says
    planned = max((e.planned for e in entries.values()), default=0) or cfg.worker.count
    slots = max((e.slots for e in entries.values()), default=0) or cfg.worker.shards
    slot = free_slot(entries, slots)
    if slot is None:
        raise UsageError(
            f"run {cfg.comm.run_id!r} is full: its {slots} data shards are all held by live workers "
            f"(a run takes volunteers up to its worker.slots)"
        )
    return Place(slot, planned, slots, entries)


def run_join(config_path: str | None, overrides: list[str], *, run_dir: str | None = None) -> int:
    """``diloco join``: a worker in a free slot of the live run whose peers ``overrides`` name, with
    ``config_path`` or, without one, the run's own config from a live peer (the volunteer's
    ``overrides`` on top); ``run_dir``: ``--run-dir``. Its exit code."""
    cfg, place = place_in_run(config_path, overrides)
    overrides = [*overrides, *place.overrides, *([f"run.dir={run_dir}"] if run_dir else [])]
    if config_path is not None:
        return run_worker(config_path, overrides, join=True)
    with run_config_file(place.entries, cfg.comm.run_id) as (path, digest):
        print(f"took the run's config from a live peer (sha256 {digest[:12]})", flush=True)
        return run_worker(str(path), overrides, join=True)


def place_in_run(config_path: str | None, overrides: list[str]) -> tuple[Config, Place]:
    """The volunteer's config (its ``overrides`` name the run's peers) and its free slot in the live
    run, announced on stdout."""
    cfg = load_config(config_path, overrides)
    if cfg.comm.backend != "hivemind":
        raise UsageError(f"joining a live run needs comm.backend=hivemind, not {cfg.comm.backend}")
    place = choose_slot(cfg)
    print(f"joining run {cfg.comm.run_id!r} as worker {place.slot} ({len(place.entries)} live)", flush=True)
    return cfg, place


@contextmanager
def run_config_file(entries: dict, run_id: str) -> Iterator[tuple[Path, str]]:
    """The run's config, from a live peer, as a YAML file that lasts the block; and its digest."""
    tree = config_from_run(entries, run_id)
    with tempfile.TemporaryDirectory(prefix="diloco-join-") as folder:
        path = Path(folder) / "run-config.yaml"
        path.write_text(OmegaConf.to_yaml(tree))
        yield path, config_digest(tree)
