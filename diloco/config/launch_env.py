"""What ``diloco launch`` tells each process it starts, through the environment, and how
``diloco.init()`` reads it back: one variable, ``DILOCO_LAUNCH``, holding JSON.

    {"config": "configs/tiny.yaml" | null,       # the launcher's config file
     "overrides": ["outer.sync_every=20", ...],  # its KEY=VALUE overrides, then the worker's own
     "join": false}                              # true: a live run is required (a volunteer)

The worker's own overrides (``worker.index``, ``worker.count``, ``run.dir``,
``comm.hivemind.initial_peers``, ``worker.threads``) come last, so that the launcher's command line
outranks what the script passes to ``diloco.init()``, as a command line outranks a YAML file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from diloco.errors import ConfigError

LAUNCH_ENV = "DILOCO_LAUNCH"


@dataclass(frozen=True)
class Launch:
    """One process's share of a launch: its config file, its overrides, whether it joins a live run."""

    config: str | None = None
    overrides: tuple[str, ...] = field(default_factory=tuple)
    join: bool = False

    def to_environment(self) -> dict[str, str]:
        """The variable to add to the process's environment."""
        payload = {"config": self.config, "overrides": list(self.overrides), "join": self.join}
        return {LAUNCH_ENV: json.dumps(payload)}


def launch_from_environment(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launch this process belongs to; None when it was not started by ``diloco launch``."""
    text = (os.environ if environ is None else environ).get(LAUNCH_ENV)
    if not text:
        return None
    try:
        payload = json.loads(text)
        config, overrides, join = payload.get("config"), payload.get("overrides", []), payload.get("join", False)
        listed = isinstance(overrides, list) and all(isinstance(item, str) for item in overrides)
        valid = (config is None or isinstance(config, str)) and listed
    except (ValueError, AttributeError, TypeError):
        valid = False
    if not valid:
        raise ConfigError(
            f"{LAUNCH_ENV} is not what diloco launch writes: unset it, or start the script with diloco launch"
        )
    return Launch(config=config, overrides=tuple(overrides), join=bool(join))
