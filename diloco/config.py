"""The typed configuration schema and its loader.

Each component owns its settings dataclass beside its code (``ModelConfig`` in models/gpt.py,
``OuterConfig`` in outer.py, ...); ``Config`` composes them. ``load_config`` merges, in order:
the dataclass defaults, a YAML file (a short diff from the defaults), and ``KEY=VALUE``
overrides from the command line, with omegaconf's struct mode on so a typo is an error::

    cfg = load_config("configs/tiny.yaml", ["outer.sync_every=20", "inner.lr=3e-4"])

Every mistake a user can make here raises ``ConfigError`` with one line that names the key
and what is allowed; the CLI prints it and exits 2.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from diloco.comm import BACKENDS, DATA_PLANES, CommConfig
from diloco.compression import CompressionConfig, build_codec
from diloco.core.inner import PRECISIONS, InnerConfig, validate_inner_config
from diloco.core.outer import OuterConfig, validate_outer_config
from diloco.core.overlap import validate_overlap_config
from diloco.data.corpus import DataConfig
from diloco.errors import ConfigError, require
from diloco.models.gpt import ModelConfig, validate_model_config
from diloco.optional_deps import is_installed, missing_message
from diloco.worker.checkpoint import CheckpointConfig
from diloco.worker.faults import BAD_PAYLOADS, FaultConfig
from diloco.worker.metrics import WANDB_MODES, LoggingConfig

SITE_SHARDINGS = ("ddp", "fsdp")


@dataclass
class RunConfig:
    name: str = "diloco"  # run name: labels the run directory, wandb group and plots
    dir: str = ""  # run directory; "" = runs/<name>


@dataclass
class WorkerConfig:
    index: int = 0  # this worker's number: picks its data shard and its worker-<index>.jsonl
    count: int = 1  # workers planned for the run: the group size rounds wait for
    slots: int = 0  # data shards, so the most workers the run can hold (volunteers join free ones); 0 = count
    threads: int = 0  # torch intra-op threads; 0 = torch's default (launchers set cores / workers)
    device: str = "cpu"  # where inner steps run: cpu / cuda / auto (cuda when available)
    site: bool = False  # under torchrun: all its ranks are this one worker (data-parallel inside; worker/sites.py)
    site_sharding: str = "ddp"  # inside a site: ddp (rank 0 syncs for all) / fsdp (FSDP2; each rank syncs its shard)
    precision: str = "fp32"  # the inner step's forward: fp32 / bf16 (autocast; params and optimizer stay fp32)
    compile: bool = False  # torch.compile the model (in place: checkpoints keep their keys); pays off on a GPU

    @property
    def shards(self) -> int:
        """How many disjoint shards the train split is cut into."""
        return max(self.count, self.slots)


@dataclass
class Config:
    seed: int = 0  # same seed -> same initial model on every worker and the same data order
    run: RunConfig = field(default_factory=RunConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) if self.run.dir else Path("runs") / self.run.name


CLIENT_MODES = ("auto", "true", "false")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- ``KEY=VALUE`` overrides, validated. Raises ConfigError."""
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, True)
    layers = []
    if path is not None:
        layers.append(_read_yaml(Path(path)))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (for example inner.lr=3e-4)")
    # omegaconf reads a bare KEY= as null; on a command line it means the empty string
    overrides = [f"{item}''" if item.endswith("=") else item for item in overrides]
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(schema, *layers)
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
        conf.comm.run_key = "<set>"
    return conf


def _read_yaml(path: Path):
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = OmegaConf.load(path)
    except Exception as error:  # yaml.YAMLError and friends: report, don't trace
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"config file {path} is not valid YAML: {first_line}") from None
    if loaded is None or not OmegaConf.is_dict(loaded):
        raise ConfigError(f"config file {path} must be a mapping of sections (model:, inner:, ...)")
    return loaded


def _describe(error: OmegaConfBaseException) -> str:
    """One line from omegaconf's multi-line messages: the key, then what went wrong."""
    key = getattr(error, "full_key", None) or ""
    message = str(error).strip().splitlines()[0]
    if "Key" in message and "not in" in message or "Could not override" in message:
        return f"unknown config key {key!r} (`diloco config` prints every key)"
    if "Value" in message and ("could not be converted" in message or "is not a" in message):
        expected = getattr(error, "msg", message)
        return f"{key}: {expected.splitlines()[0]}"
    return f"{key}: {message}" if key else message


def _check_data(data: DataConfig) -> None:
    require(0 < data.val_fraction < 1, f"data.val_fraction={data.val_fraction} must be in (0, 1)")
    require(data.shard_chunk >= 0, f"data.shard_chunk={data.shard_chunk} must be >= 0 (0 = contiguous shards)")
    require(not (data.path and data.dataset), "set one of data.path (text files) and data.dataset (a HF dataset)")
    has_glob = any(char in data.dataset for char in "*?[")
    require(
        not data.dataset or has_glob or Path(data.dataset).expanduser().exists(),
        f"data.dataset={data.dataset!r} does not exist",
    )
    require(bool(data.text_field), "data.text_field must name the column that holds the text")
    require(
        not data.tokenizer or Path(data.tokenizer).expanduser().exists(),
        f"data.tokenizer={data.tokenizer!r} does not exist (a local folder or tokenizer.json; nothing is downloaded)",
    )
    # the token cache streams a Hugging Face dataset; data.path and the embedded corpus are read into memory
    require(not data.token_cache or bool(data.dataset), "data.token_cache needs data.dataset (the corpus it caches)")
    require(
        not Path(data.token_cache).expanduser().is_file(),
        f"data.token_cache={data.token_cache!r} is a file; it names a folder (created if missing)",
    )


def _check_hf_extra(cfg: Config) -> None:
    """Settings that need the optional ``hf`` extra, checked without importing it."""
    needs = [
        ("transformers", "model.kind=hf", cfg.model.kind == "hf"),
        ("transformers", "data.tokenizer", bool(cfg.data.tokenizer)),
        ("datasets", "data.dataset", bool(cfg.data.dataset)),
    ]
    for module, setting, needed in needs:
        require(not needed or is_installed(module), missing_message(module, setting))


def _check_site(cfg: Config) -> None:
    """A site (several ranks as one worker) syncs across sites over hivemind, one blocking round at a time."""
    sharding = cfg.worker.site_sharding
    require(sharding in SITE_SHARDINGS, f"worker.site_sharding={sharding!r} is not one of {', '.join(SITE_SHARDINGS)}")
    require(sharding == "ddp" or cfg.worker.site, f"worker.site_sharding={sharding} needs worker.site=true")
    if not cfg.worker.site:
        return
    backend, overlap = cfg.comm.backend, cfg.outer.overlap
    require(backend == "hivemind", f"worker.site=true syncs sites over hivemind, not comm.backend={backend}")
    require(cfg.outer.sync_every > 0, "worker.site=true needs rounds (outer.sync_every > 0)")
    require(overlap == "none", f"worker.site=true runs blocking rounds: outer.overlap=none, not {overlap}")


def _section(check, section) -> None:
    """A section's own checks, beside its code (they raise ``ValueError``), as a ``ConfigError``."""
    try:
        check(section)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def validate(cfg: Config) -> None:
    """Combinations the schema's types cannot express. Each failure names the key to change. A
    section's own checks live beside its code (``validate_outer_config``, ...); those across
    sections are here."""
    _check_hf_extra(cfg)
    _section(validate_model_config, cfg.model)
    require(cfg.worker.count >= 1, f"worker.count={cfg.worker.count} must be at least 1")
    _check_site(cfg)
    require(cfg.worker.slots >= 0, f"worker.slots={cfg.worker.slots} must be >= 0 (0 = worker.count)")
    require(
        0 <= cfg.worker.index < cfg.worker.shards,
        f"worker.index={cfg.worker.index} must be in [0, {cfg.worker.shards}) "
        f"(worker.count={cfg.worker.count}, worker.slots={cfg.worker.slots})",
    )
    require(
        cfg.worker.device in ("cpu", "cuda", "auto"), f"worker.device={cfg.worker.device!r} is not cpu, cuda or auto"
    )
    require(
        cfg.worker.precision in PRECISIONS,
        f"worker.precision={cfg.worker.precision!r} is not one of {', '.join(PRECISIONS)}",
    )
    require(cfg.worker.threads >= 0, f"worker.threads={cfg.worker.threads} must be >= 0 (0 = torch default)")
    _section(validate_inner_config, cfg.inner)
    _section(validate_outer_config, cfg.outer)
    _section(validate_overlap_config, cfg.outer)
    require(
        cfg.outer.global_device == "cpu" or cfg.outer.overlap == "none",
        f"outer.global_device={cfg.outer.global_device} works with blocking rounds only (outer.overlap=none); "
        "overlapped rounds keep the global params on the cpu",
    )
    _section(build_codec, cfg.compression)  # the codec checks its own settings as it is made
    require(
        cfg.compression.name == "none" or cfg.outer.sync_every > 0,
        f"compression.name={cfg.compression.name} compresses pseudo-gradients; the data-parallel baseline "
        "(outer.sync_every=0) sends fp32 gradients: use compression.name=none",
    )
    require(
        cfg.faults.bad_payload in BAD_PAYLOADS,
        f"faults.bad_payload={cfg.faults.bad_payload!r} is not one of {', '.join(BAD_PAYLOADS[1:])} (or empty)",
    )
    require(
        not (
            cfg.faults.bad_payload not in ("", "scaled")
            and cfg.comm.backend == "torchdist"
            and cfg.compression.name == "none"
        ),
        "faults.bad_payload with comm.backend=torchdist needs a codec (compression.name): "
        "fp32 goes through a plain all-reduce there, with no payload to break",
    )
    require(cfg.logging.eval_every >= 1, f"logging.eval_every={cfg.logging.eval_every} must be at least 1")
    require(cfg.comm.bandwidth_mbps >= 0, f"comm.bandwidth_mbps={cfg.comm.bandwidth_mbps} must be >= 0 (0 = infinite)")
    require(cfg.comm.latency_ms >= 0, f"comm.latency_ms={cfg.comm.latency_ms} must be >= 0")
    require(
        cfg.comm.max_norm_ratio == 0 or cfg.comm.max_norm_ratio > 1,
        f"comm.max_norm_ratio={cfg.comm.max_norm_ratio} must be 0 (off) or above 1",
    )
    require(
        math.isfinite(cfg.faults.payload_scale),
        f"faults.payload_scale={cfg.faults.payload_scale} must be a finite number",
    )
    require(cfg.comm.backend in BACKENDS, f"comm.backend={cfg.comm.backend!r} is not one of {', '.join(BACKENDS)}")
    require(cfg.comm.run_id.isidentifier(), f"comm.run_id={cfg.comm.run_id!r} must be letters, digits and _")
    bad_peers = [peer for peer in cfg.comm.initial_peers if not peer.startswith("/")]
    require(
        not bad_peers,
        f"comm.initial_peers: {bad_peers[0] if bad_peers else ''!r} is not a multiaddr "
        "(like /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...)",
    )
    cfg.comm.client_mode = str(cfg.comm.client_mode).lower()  # yaml's true/false arrive as booleans
    require(
        cfg.comm.client_mode in CLIENT_MODES,
        f"comm.client_mode={cfg.comm.client_mode!r} is not one of {', '.join(CLIENT_MODES)}",
    )
    require(
        cfg.comm.data_plane in DATA_PLANES,
        f"comm.data_plane={cfg.comm.data_plane!r} is not one of {', '.join(DATA_PLANES)}",
    )
    require(cfg.comm.deadline_s > 0, f"comm.deadline_s={cfg.comm.deadline_s} must be positive")
    require(0 <= cfg.comm.port < 65536, f"comm.port={cfg.comm.port} must be in [0, 65535]")
    require(
        0 < cfg.comm.request_timeout_s < cfg.comm.matchmaking_s,
        f"comm.request_timeout_s={cfg.comm.request_timeout_s} must be positive and below "
        f"comm.matchmaking_s={cfg.comm.matchmaking_s} (hivemind can deadlock otherwise)",
    )
    require(
        cfg.comm.matchmaking_s < cfg.comm.deadline_s,
        f"comm.matchmaking_s={cfg.comm.matchmaking_s} must be below comm.deadline_s={cfg.comm.deadline_s}",
    )
    require(
        cfg.logging.wandb in WANDB_MODES,
        f"logging.wandb={cfg.logging.wandb!r} is not one of {', '.join(WANDB_MODES)}",
    )
    require(cfg.logging.log_every >= 1, f"logging.log_every={cfg.logging.log_every} must be at least 1")
    require(
        cfg.checkpoint.every_rounds >= 0,
        f"checkpoint.every_rounds={cfg.checkpoint.every_rounds} must be >= 0",
    )
    _check_data(cfg.data)
