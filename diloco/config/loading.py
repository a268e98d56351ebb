"""``load_config``: the dataclass defaults <- an outer rule's defaults (rules.py) <- a YAML file
<- ``KEY=VALUE`` overrides, with omegaconf's struct mode on so a typo is an error, then checked
(checks.py); and the config written back (``save_config``, ``to_yaml``, ``to_dict``, ``masked``).

A key that moved (``MOVED_KEYS``) is an error naming its new place, in an override and in a file
alike; so is a value of another shape than the schema's (shapes.py). A file's mistakes name the
file, and a YAML error its line and column."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from diloco.comm.hivemind.settings import HivemindConfig
from diloco.comm.run_key_env import MASKED_RUN_KEY
from diloco.config.checks import validate
from diloco.config.rules import rule_defaults
from diloco.config.schema import Config
from diloco.config.shapes import check_shapes
from diloco.config.trust import FROM_REACH, default_trust, trust_defaults
from diloco.errors import ConfigError


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    defaults: dict | None = None,
) -> Config:
    """Defaults <- ``defaults`` (a script's own, as nested sections) <- YAML file <- ``KEY=VALUE``
    overrides, validated. Raises ConfigError."""
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, True)
    layers = []
    if defaults:
        try:
            layer = OmegaConf.create(defaults)
        except OmegaConfBaseException as error:
            raise ConfigError(_describe(error)) from None
        check_shapes(schema, layer, in_file=False)
        layers.append(layer)
    if path is not None:
        layers.append(_read_yaml(Path(path), schema))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (for example inner.lr=3e-4)")
    # omegaconf reads a bare KEY= as null; on a command line it means the empty string
    overrides = [f"{item}''" if item.endswith("=") else item for item in overrides]
    try:
        command_line = OmegaConf.from_dotlist(list(overrides))
        check_shapes(schema, command_line, in_file=False)
        layers.append(command_line)
        merged = OmegaConf.merge(schema, *layers)
        if merged.comm.trust == FROM_REACH:  # written into the config: a resume or a join takes it as it is
            layers.append(OmegaConf.create({"comm": {"trust": default_trust(merged)[0]}}))
            merged = OmegaConf.merge(schema, *layers)
        # an outer rule's and the trust level's defaults for other sections, under what the user set
        implied = [rule_defaults(merged.outer.optimizer), trust_defaults(merged.comm.trust)]
        if (trust := OmegaConf.select(command_line, "comm.trust")) is not None:
            # a trust level given on the command line outranks the screening keys of the file too (a
            # run's written config.yaml sets them all), not the screening keys beside it
            layers.insert(-1, trust_defaults(trust))
        merged = OmegaConf.merge(schema, *implied, *layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(_describe(error)) from None
    if cfg.comm.backend == "inproc":  # the simulator's earlier name, kept for the commands of older results
        cfg.comm.backend = "simulator"
    validate(cfg)
    return cfg


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (atomically) so a run records what it ran."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, path)


def to_yaml(cfg: Config) -> str:
    """The config as YAML, the run key masked (it is written to run directories and logs)."""
    return OmegaConf.to_yaml(_redacted(cfg))


def to_dict(cfg: Config) -> dict:
    """The config as plain containers, the run key masked."""
    return OmegaConf.to_container(_redacted(cfg))


def masked(cfg: Config) -> Config:
    """A copy of the config with the run key masked, for printing."""
    return OmegaConf.to_object(_redacted(cfg))


def _redacted(cfg: Config):
    conf = OmegaConf.structured(cfg)
    if conf.comm.run_key:
        conf.comm.run_key = MASKED_RUN_KEY
    return conf


def _read_yaml(path: Path, schema):
    if path.is_dir():
        raise ConfigError(
            f"config file {path} is a directory, not a YAML config file (such as configs/tiny.yaml, "
            "or a run directory's config.yaml)"
        )
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except Exception as error:  # yaml.YAMLError and friends: report, don't trace
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(error)}") from None
    if loaded is None or not OmegaConf.is_dict(loaded):
        raise ConfigError(f"config file {path} must be a mapping of sections (model:, inner:, ...)")
    _refuse_old_places(loaded, path)
    try:
        check_shapes(schema, loaded, in_file=True)
    except ConfigError as error:
        raise ConfigError(f"config file {path}: {error}") from None
    return loaded


def _yaml_problem(error: Exception) -> str:
    """Where and what, and what yaml was reading there: ``line 4, column 6: did not find expected
    ',' or ']' (while parsing a flow sequence from line 3, column 10)``."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is not None and problem:
        where = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
        start, context = getattr(error, "context_mark", None), getattr(error, "context", None)
        if start is not None and context:
            where += f" ({context} from line {start.line + 1}, column {start.column + 1})"
        return where
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _refuse_old_places(loaded, path: Path) -> None:
    """A key of ``loaded`` that moved (``MOVED_KEYS``) is an error naming its new place, as on the
    command line."""
    comm = loaded.get("comm")
    if not OmegaConf.is_dict(comm):
        return
    for name in comm:
        if (new := MOVED_KEYS.get(f"comm.{name}")) is not None:
            raise ConfigError(
                f"config file {path}: comm.{name} is now {new}: move it under `comm: hivemind:` in the file"
            )


# keys that moved to a section of their own: the old key -> the new one (every hivemind setting
# was a comm.* key before comm.hivemind)
MOVED_KEYS = {f"comm.{f.name}": f"comm.hivemind.{f.name}" for f in dataclasses.fields(HivemindConfig)}


def _describe(error: OmegaConfBaseException) -> str:
    """One line from omegaconf's multi-line messages: the key, then what went wrong."""
    key = getattr(error, "full_key", None) or ""
    message = str(error).strip().splitlines()[0]
    if "Key" in message and "not in" in message or "Could not override" in message:
        if key in MOVED_KEYS:
            return f"{key} is now {MOVED_KEYS[key]} (the settings only hivemind reads have a section of their own)"
        return f"unknown config key {key!r} (`diloco config` prints every key)"
    if "Value" in message and ("could not be converted" in message or "is not a" in message):
        expected = getattr(error, "msg", message)
        return f"{key}: {expected.splitlines()[0]}"
    return f"{key}: {message}" if key else message
