"""``validate``: the checks across sections, which no one section's module can make (a site
needs hivemind and blocking rounds, a codec needs DiLoCo rounds, ...). A section's own checks
live beside its code (``validate_outer_config`` in core/outer.py, ...) and run from here too.
Each failure is a ``ConfigError`` of one line that names the key to change."""

from __future__ import annotations

import math

from diloco.comm import BACKENDS, DATA_PLANES
from diloco.comm.run_key_env import RUN_KEY_ENV, resolve_run_key
from diloco.compression import ADAPTIVE, validate_compression_config
from diloco.config.run_dir import check_run_dir
from diloco.config.schema import BAD_PAYLOADS, CLIENT_MODES, FORGED_PAYLOADS, SITE_SHARDINGS, WANDB_MODES, Config
from diloco.config.trust import TRUST_LEVELS
from diloco.core.inner import PRECISIONS, validate_inner_config
from diloco.core.outer import validate_outer_config
from diloco.core.overlap import validate_overlap_config
from diloco.data.source import validate_data_config
from diloco.errors import ConfigError, require
from diloco.models.gpt import validate_model_config
from diloco.optional_deps import is_installed, missing_message


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
    require(
        sharding == "ddp" or cfg.inner.optimizer != "muon",
        f"inner.optimizer=muon orthogonalises whole matrices, and worker.site_sharding={sharding} splits them "
        "across ranks: use worker.site_sharding=ddp",
    )
    if not cfg.worker.site:
        return
    backend, overlap = cfg.comm.backend, cfg.outer.overlap
    require(backend == "hivemind", f"worker.site=true syncs sites over hivemind, not comm.backend={backend}")
    require(cfg.outer.sync_every > 0, "worker.site=true needs rounds (outer.sync_every > 0)")
    require(overlap == "none", f"worker.site=true runs blocking rounds: outer.overlap=none, not {overlap}")


def _check_adaptive(cfg: Config) -> None:
    """A codec agreed per round needs peers that declare what they prefer (hivemind's matchmaking)
    and one round at a time (its error feedback settles when the round names the codec)."""
    if cfg.compression.name != ADAPTIVE:
        return
    backend, overlap = cfg.comm.backend, cfg.outer.overlap
    require(backend == "hivemind", f"compression.name=adaptive needs comm.backend=hivemind, not {backend}")
    require(overlap == "none", f"compression.name=adaptive runs blocking rounds: outer.overlap=none, not {overlap}")
    require(
        not cfg.faults.bad_payload,
        "faults.bad_payload breaks a fixed codec's payloads: set a compression.name other than adaptive",
    )


def _check_worker(cfg: Config) -> None:
    """The ``worker.*`` settings, each alone and against the run's plan."""
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
    require(
        0 <= cfg.worker.gpu_memory_fraction <= 1,
        f"worker.gpu_memory_fraction={cfg.worker.gpu_memory_fraction} must be in [0, 1] (0 = all of the GPU)",
    )


def _check_outer(cfg: Config) -> None:
    """The ``outer.*`` settings, of the blocking and the overlapped outer step."""
    validate_outer_config(cfg.outer)
    validate_overlap_config(cfg.outer)
    require(
        cfg.outer.global_device == "cpu" or cfg.outer.overlap == "none",
        f"outer.global_device={cfg.outer.global_device} works with blocking rounds only (outer.overlap=none); "
        "overlapped rounds keep the global params on the cpu",
    )


def _check_compression(cfg: Config) -> None:
    """The codec alone, and against the outer rule and the rounds that send what it compresses."""
    validate_compression_config(cfg.compression)
    require(
        cfg.outer.optimizer != "sparseloco"
        or (cfg.compression.name not in ("none", ADAPTIVE) and cfg.compression.error_feedback),
        "outer.optimizer=sparseloco takes its momentum from the error feedback of a lossy codec: "
        f"set compression.error_feedback=true and a codec other than none (compression.name={cfg.compression.name})",
    )
    _check_adaptive(cfg)
    require(
        cfg.compression.name == "none" or cfg.outer.sync_every > 0,
        f"compression.name={cfg.compression.name} compresses pseudo-gradients; the data-parallel baseline "
        "(outer.sync_every=0) sends fp32 gradients: use compression.name=none",
    )


def _check_faults(cfg: Config) -> None:
    """The ``faults.*`` settings: a bad payload needs a payload to break."""
    require(
        cfg.faults.bad_payload in BAD_PAYLOADS,
        f"faults.bad_payload={cfg.faults.bad_payload!r} is not one of {', '.join(BAD_PAYLOADS[1:])} (or empty)",
    )
    require(
        not (
            cfg.faults.bad_payload not in ("", *FORGED_PAYLOADS)
            and cfg.comm.backend == "torchdist"
            and cfg.compression.name == "none"
        ),
        "faults.bad_payload with comm.backend=torchdist needs a codec (compression.name): "
        "fp32 goes through a plain all-reduce there, with no payload to break",
    )
    require(cfg.faults.count >= 1, f"faults.count={cfg.faults.count} must be at least 1")
    require(
        math.isfinite(cfg.faults.payload_scale),
        f"faults.payload_scale={cfg.faults.payload_scale} must be a finite number",
    )
    require(
        math.isfinite(cfg.faults.weight_scale) and cfg.faults.weight_scale > 0,
        f"faults.weight_scale={cfg.faults.weight_scale} must be a positive number",
    )


def _check_screening(cfg: Config) -> None:
    """``comm.max_weight_ratio``, ``comm.min_cosine``, ``comm.exclude_after`` and
    ``comm.readmit_after``, and the transports that can apply them."""
    require(
        cfg.comm.exclude_after >= 0,
        f"comm.exclude_after={cfg.comm.exclude_after} must be 0 (never) or a number of rounds",
    )
    require(
        cfg.comm.readmit_after >= 0,
        f"comm.readmit_after={cfg.comm.readmit_after} must be 0 (never) or a number of rounds",
    )
    require(
        cfg.comm.max_weight_ratio == 0 or cfg.comm.max_weight_ratio >= 1,
        f"comm.max_weight_ratio={cfg.comm.max_weight_ratio} must be 0 (off) or at least 1",
    )
    require(
        -1 <= cfg.comm.min_cosine < 1,
        f"comm.min_cosine={cfg.comm.min_cosine} must be in [-1, 1) (-1 = off)",
    )
    require(
        cfg.comm.min_cosine == -1 or cfg.comm.backend != "torchdist",
        "comm.min_cosine screens whole contributions, and comm.backend=torchdist sums them in one all-reduce: "
        "set comm.trust=trusted (or comm.min_cosine=-1) with it: ranks of one torchrun trust each other",
    )
    require(
        cfg.comm.min_cosine == -1 or cfg.outer.sync_every != 0,
        "comm.min_cosine screens pseudo-gradients; outer.sync_every=0 (the data-parallel baseline) averages "
        "one step's gradients, too noisy to judge: set comm.trust=trusted (or comm.min_cosine=-1) with it",
    )
    require(
        cfg.comm.min_cosine == -1 or cfg.comm.hivemind.data_plane != "gloo",
        "comm.min_cosine screens what a reducer receives, and comm.hivemind.data_plane=gloo sums vectors nobody "
        "sees: set comm.trust=trusted (or comm.min_cosine=-1) with it, between sites that trust each other",
    )


def _check_trust(cfg: Config) -> None:
    """``comm.trust``: a known level, and a keyed run holds its key."""
    trust = cfg.comm.trust
    require(trust in TRUST_LEVELS, f"comm.trust={trust!r} is not one of {', '.join(TRUST_LEVELS)}")
    require(
        trust != "keyed" or cfg.comm.backend != "hivemind" or resolve_run_key(cfg.comm.run_key),
        f"comm.trust=keyed needs the run's key: set comm.run_key or ${RUN_KEY_ENV}",
    )


def _check_comm(cfg: Config) -> None:
    """The ``comm.*`` settings: the transport, the screening of contributions, a round's deadline;
    then ``comm.hivemind.*``."""
    require(cfg.comm.bandwidth_mbps >= 0, f"comm.bandwidth_mbps={cfg.comm.bandwidth_mbps} must be >= 0 (0 = infinite)")
    require(cfg.comm.latency_ms >= 0, f"comm.latency_ms={cfg.comm.latency_ms} must be >= 0")
    require(
        cfg.comm.max_norm_ratio == 0 or cfg.comm.max_norm_ratio > 1,
        f"comm.max_norm_ratio={cfg.comm.max_norm_ratio} must be 0 (off) or above 1",
    )
    _check_trust(cfg)
    _check_screening(cfg)
    require(cfg.comm.backend in BACKENDS, f"comm.backend={cfg.comm.backend!r} is not one of {', '.join(BACKENDS)}")
    require(cfg.comm.run_id.isidentifier(), f"comm.run_id={cfg.comm.run_id!r} must be letters, digits and _")
    require(cfg.comm.deadline_s > 0, f"comm.deadline_s={cfg.comm.deadline_s} must be positive")
    _check_hivemind(cfg)


def _check_hivemind(cfg: Config) -> None:
    """The ``comm.hivemind.*`` settings: its peers, how it listens and the bounds of its waits."""
    hm = cfg.comm.hivemind
    bad_peers = [peer for peer in hm.initial_peers if not peer.startswith("/")]
    require(
        not bad_peers,
        f"comm.hivemind.initial_peers: {bad_peers[0] if bad_peers else ''!r} is not a multiaddr "
        "(like /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...)",
    )
    hm.client_mode = str(hm.client_mode).lower()  # yaml's true/false arrive as booleans
    require(
        hm.client_mode in CLIENT_MODES,
        f"comm.hivemind.client_mode={hm.client_mode!r} is not one of {', '.join(CLIENT_MODES)}",
    )
    require(
        hm.data_plane in DATA_PLANES,
        f"comm.hivemind.data_plane={hm.data_plane!r} is not one of {', '.join(DATA_PLANES)}",
    )
    require(0 <= hm.port < 65536, f"comm.hivemind.port={hm.port} must be in [0, 65535]")
    require(
        hm.heartbeat_s >= 0.5,
        f"comm.hivemind.heartbeat_s={hm.heartbeat_s} must be at least 0.5 s (a record lives 4 heartbeats, "
        "and a DHT write can take a second on a loaded machine)",
    )
    require(
        0 < hm.request_timeout_s < hm.matchmaking_s,
        f"comm.hivemind.request_timeout_s={hm.request_timeout_s} must be positive and below "
        f"comm.hivemind.matchmaking_s={hm.matchmaking_s} (hivemind can deadlock otherwise)",
    )
    require(
        hm.matchmaking_s < cfg.comm.deadline_s,
        f"comm.hivemind.matchmaking_s={hm.matchmaking_s} must be below comm.deadline_s={cfg.comm.deadline_s}",
    )


def _check_records(cfg: Config) -> None:
    """The ``logging.*`` and ``checkpoint.*`` settings and the run directory: what a worker
    records and keeps, and where."""
    check_run_dir(cfg.run_dir)
    require(cfg.logging.eval_every >= 1, f"logging.eval_every={cfg.logging.eval_every} must be at least 1")
    for key in ("eval_batches", "eval_batch_size"):  # none: a round's val_loss would be NaN, or a traceback
        value = getattr(cfg.logging, key)
        require(value >= 1, f"logging.{key}={value} must be at least 1 (the held-out loss needs a batch)")
    require(
        cfg.logging.wandb in WANDB_MODES,
        f"logging.wandb={cfg.logging.wandb!r} is not one of {', '.join(WANDB_MODES)}",
    )
    require(cfg.logging.log_every >= 1, f"logging.log_every={cfg.logging.log_every} must be at least 1")
    require(
        cfg.checkpoint.every_rounds >= 0,
        f"checkpoint.every_rounds={cfg.checkpoint.every_rounds} must be >= 0",
    )
    require(
        0 <= cfg.checkpoint.max_share < 1,
        f"checkpoint.max_share={cfg.checkpoint.max_share} must be in [0, 1) (0: every due checkpoint)",
    )
    require(
        cfg.checkpoint.keep >= 1,
        f"checkpoint.keep={cfg.checkpoint.keep} must be at least 1 (checkpoint.every_rounds=0 writes none)",
    )


def validate(cfg: Config) -> None:
    """Combinations the schema's types cannot express. Each failure names the key to change. A
    section's own checks live beside its code (``validate_outer_config``, ...); those across
    sections are here."""
    _check_hf_extra(cfg)
    try:
        validate_model_config(cfg.model)
    except ValueError as error:  # the model's checks raise ValueError (models/gpt.py, models/hf.py)
        raise ConfigError(str(error)) from None
    _check_worker(cfg)
    validate_inner_config(cfg.inner)
    _check_outer(cfg)
    _check_compression(cfg)
    _check_faults(cfg)
    _check_comm(cfg)
    _check_records(cfg)
    validate_data_config(cfg.data)
