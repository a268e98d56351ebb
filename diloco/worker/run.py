"""The run a process trains in, as the library sees it: ``diloco.init()`` returns it.

    run = diloco.init()                                   # under diloco launch: its environment
    run = diloco.init("configs/tiny.yaml", "outer.sync_every=20")
    run = diloco.init(outer={"sync_every": 20}, worker={"index": 1, "count": 2})

The config is loaded as ``diloco train`` loads it (defaults <- YAML file <- overrides), with the
script's keywords as its own defaults under any file, and what ``diloco launch`` passes in the
environment over what the script passes: the launcher's config file replaces the script's (a
volunteer's: the run's own, from a live peer); its overrides and the worker's own come last, as a
command line outranks a file. Under torchrun each rank is a worker (with ``comm.backend=torchdist`` its
rounds average over torch.distributed) unless the ranks are one site (``worker.site=true``), as with
``diloco train``.

A ``Run`` tells the user's loop what it needs to shard its data (``data_index`` of
``data_count``: the worker's index among the workers and, on a site, its rank among the site's
ranks) and where to put its model (``device``; ``place`` a model, which a sharded site must do
before building the inner optimizer).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from diloco.comm.bounds import site_limit_s
from diloco.config import Config, ConfigError, load_config
from diloco.config.launch_env import launch_from_environment
from diloco.worker.placement import Placement, placement_for


@dataclass
class Run:
    """One process's place in a run: its config (``config``), where its model lives and which of
    its processes talks to the run (``placement``), and whether it must join a live run."""

    config: Config
    placement: Placement
    join: bool = False  # a volunteer: a live run is required (diloco launch --join)
    _synced: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, repr=False)

    @classmethod
    def from_config(cls, cfg: Config, *, join: bool = False) -> Run:
        """The run of ``cfg`` (threads, device and its memory share set up for this process)."""
        if cfg.worker.threads:
            torch.set_num_threads(cfg.worker.threads)
        device = _device(cfg.worker.device)
        if device.type == "cuda" and cfg.worker.gpu_memory_fraction:  # workers sharing a GPU: each its share
            torch.cuda.set_per_process_memory_fraction(cfg.worker.gpu_memory_fraction, device)
        placement = placement_for(cfg.worker, device, site_timeout_s=site_limit_s(cfg.comm.deadline_s))
        if join:
            placement.check_join()
        return cls(cfg, placement, join=join)

    @property
    def worker_index(self) -> int:
        return self.config.worker.index

    @property
    def worker_count(self) -> int:
        return self.config.worker.count

    @property
    def rank(self) -> int:
        """This process's rank in its site (0 where a worker is one process)."""
        return self.placement.rank

    @property
    def leader(self) -> bool:
        """Whether this process writes the worker's records (a site's rank 0): the one to print."""
        return self.placement.leader

    @property
    def data_index(self) -> int:
        """This process's shard of the data: the worker's index, and on a site its rank in it."""
        return self.config.worker.index * self.placement.ranks + self.placement.rank

    @property
    def data_count(self) -> int:
        """How many shards the data is split in: one per slot of the run (``worker.slots``, at least
        ``worker.count``: a volunteer's index may be past the count), times a site's ranks."""
        return self.config.worker.shards * self.placement.ranks

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    def place(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to this process's device (on a sharded site: shard it); returns it. A
        model the script does not place is placed when ``DiLoCo`` starts; a sharded site's must be
        placed before its inner optimizer is built (the optimizer holds the shards)."""
        if model not in self._synced:
            self._synced[model] = self.placement.place(model)
        return model

    def synced_params(self, model: nn.Module) -> list[torch.Tensor]:
        """What the outer step averages of ``model`` (placed first if it was not)."""
        self.place(model)
        return self._synced[model]


def init(config: str | os.PathLike | None = None, *overrides: str, join: bool = False, **sections) -> Run:
    """The run this process trains in. Its config, each layer over the one before: the defaults,
    ``sections`` (the script's own defaults: ``outer={"sync_every": 20}``, or
    ``**{"outer.sync_every": 20}``), a YAML file (``diloco launch``'s, else ``config``), the script's
    ``overrides`` (``KEY=VALUE``), then the launcher's overrides and the worker's own. ``join``: a
    live run is required. Raises ``ConfigError`` (one line) on a mistake."""
    if isinstance(config, str) and "=" in config and not Path(config).exists():  # init(*sys.argv[1:]): no file
        config, overrides = None, (config, *overrides)
    defaults, given = _sections_layer(sections), list(overrides)
    launch = launch_from_environment()
    if launch is not None:
        config = launch.config if launch.config is not None else config
        given, join = [*given, *launch.overrides], join or launch.join
    cfg = worker_config(config, given, defaults=defaults)
    return Run.from_config(cfg, join=join)


def worker_config(config: str | os.PathLike | None, overrides: list[str], *, defaults: dict | None = None) -> Config:
    """One worker process's config (``load_config``'s layers). Under torchrun each rank is a worker
    (its index and the count from ``RANK`` and ``WORLD_SIZE``) unless the ranks are one site; a
    process that would be one of several simulated workers is refused (they are threads of
    ``diloco local``)."""
    cfg = load_config(config, overrides, defaults=defaults)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not cfg.worker.site:
        torchrun = [f"worker.index={os.environ['RANK']}", f"worker.count={os.environ['WORLD_SIZE']}"]
        cfg = load_config(config, [*torchrun, *overrides], defaults=defaults)
    if cfg.comm.backend == "simulator" and cfg.worker.count > 1:
        raise ConfigError(
            f"comm.backend=simulator runs a run's workers as threads of one process: `diloco local --workers "
            f"{cfg.worker.count}` starts them (this process is one worker, whose rounds would wait for the others)"
        )
    return cfg


def _sections_layer(sections: dict) -> dict:
    """``init``'s keywords as nested sections, merged: a section's dict, a dotted key's value, or a
    top-level setting's (``seed=1``)."""
    top = {f.name for f in dataclasses.fields(Config)}
    layer: dict = {}
    for name, value in sections.items():
        if isinstance(value, dict):
            _merge(layer.setdefault(name, {}), value)
        elif "." in name:
            *path, key = name.split(".")
            _merge(layer, _nested(path, {key: value}))
        elif name in top:
            layer[name] = value
        else:
            raise ConfigError(f"diloco.init({name}=...) is not a setting of the config: see docs/configuration.md")
    return layer


def _nested(path: list[str], leaf: dict) -> dict:
    for part in reversed(path):
        leaf = {part: leaf}
    return leaf


def _merge(into: dict, more: dict) -> None:
    """``more`` into ``into``, section by section."""
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("worker.device=cuda but no CUDA device is visible; use worker.device=cpu or auto")
    return torch.device(name)
