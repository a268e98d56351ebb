"""The typed configuration: its schema, loader, checks and reference.

- ``schema.py``     ``Config``, composed from each section's dataclass
- ``loading.py``    ``load_config`` (defaults <- YAML <- CLI overrides) and the config written back
- ``checks.py``     ``validate``: the checks across sections (a section's own live beside its code)
- ``shapes.py``     a section given a value, a list given a scalar: one line before omegaconf merges
- ``run_dir.py``    the run directory: a file in its place refused with the config
- ``rules.py``      the defaults an outer rule brings to other sections (``outer.optimizer=sparseloco``)
- ``reference.py``  the reference table of every key (docs/configuration.md), from the schema itself

Each component below the config owns its settings dataclass beside its code (``ModelConfig`` in
models/config.py, ``OuterConfig`` in core/outer.py, ...); the worker's sections (run, worker, logging,
checkpoint, faults) are in schema.py, since the worker sits above the config; ``Config`` composes
them. ``load_config`` merges, in order: the dataclass defaults, a YAML file (a short diff from the
defaults), and ``KEY=VALUE`` overrides from the command line, with omegaconf's struct mode on so a
typo is an error::

    cfg = load_config("configs/tiny.yaml", ["outer.sync_every=20", "inner.lr=3e-4"])

Every mistake a user can make here raises ``ConfigError`` with one line that names the key
and what is allowed; the CLI prints it and exits 2.
"""

from __future__ import annotations

from diloco.config.loading import load_config, masked, save_config, to_dict, to_yaml
from diloco.config.schema import CheckpointConfig, Config, FaultConfig, LoggingConfig, RunConfig, WorkerConfig
from diloco.errors import ConfigError

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "FaultConfig",
    "LoggingConfig",
    "RunConfig",
    "WorkerConfig",
    "load_config",
    "masked",
    "save_config",
    "to_dict",
    "to_yaml",
]
