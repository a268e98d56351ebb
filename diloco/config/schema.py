"""The schema: ``Config`` composed from each section's dataclass. A section of a layer below the
config lives beside the code it configures (``ModelConfig`` in models/config.py, ``OuterConfig`` in
core/outer.py, ...); the sections of the worker, which sits above the config, are here: the run,
the worker itself, its logging (worker/metrics.py), checkpoints (worker/checkpoint.py) and fault
injection (worker/faults.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from diloco.comm import CommConfig
from diloco.compression import CompressionConfig
from diloco.core.inner import InnerConfig
from diloco.core.outer import OuterConfig
from diloco.data.source import DataConfig
from diloco.models.config import ModelConfig

SITE_SHARDINGS = ("ddp", "fsdp")
CLIENT_MODES = ("auto", "true", "false")
WANDB_MODES = ("disabled", "offline", "online")
FORGED_PAYLOADS = ("scaled", "noise", "replay")  # faults.bad_payload values that are well-formed payloads
BAD_PAYLOADS = ("", "nan", "truncated", "wrong_size", *FORGED_PAYLOADS)


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
    site: bool = False  # under torchrun: all its ranks are this one worker (data-parallel inside; comm/sites.py)
    site_sharding: str = "ddp"  # inside a site: ddp (rank 0 syncs for all) / fsdp (FSDP2; each rank syncs its shard)
    precision: str = "fp32"  # the inner step's forward: fp32 / bf16 (autocast; params and optimizer stay fp32)
    compile: bool = False  # torch.compile the model (in place: checkpoints keep their keys); pays off on a GPU
    gpu_memory_fraction: float = 0.0  # the most of its GPU's memory this worker may take; 0 = all (diloco local: 1/M)

    @property
    def shards(self) -> int:
        """How many disjoint shards the train split is cut into."""
        return max(self.count, self.slots)


@dataclass
class LoggingConfig:
    wandb: str = "disabled"  # disabled | offline | online
    project: str = "diloco"  # wandb project name
    log_every: int = 10  # inner steps between step records / progress lines
    eval_batches: int = 8  # validation batches evaluated after each round
    eval_batch_size: int = 12  # sequences per validation batch (fixed, so runs of any batch size compare)
    eval_every: int = 50  # data-parallel runs (outer.sync_every=0): inner steps between round records


@dataclass
class CheckpointConfig:
    every_rounds: int = 1  # save every N outer rounds; 0 = never
    max_share: float = 0.05  # due ones wait while the last held training up (>1 s) over this share of the time since
    keep: int = 2  # how many recent checkpoints to keep per worker


@dataclass
class FaultConfig:
    worker: int = -1  # the worker the faults apply to; -1 = every worker
    count: int = 1  # with faults.worker=N: workers N to N + count - 1 alike (attackers in league)
    skip_round: int = 0  # this worker does not take part in round N's averaging (1-based); 0 = off
    stop_after_round: int = 0  # exit (code 3) right after round N's checkpoint, as if killed; 0 = off
    bad_payload: str = ""  # what this worker sends: nan / truncated / wrong_size / scaled / noise / replay; "" = off
    payload_scale: float = 100.0  # faults.bad_payload=scaled: the factor on everything this worker sends
    step_delay_s: float = 0.0  # this worker sleeps this long after every inner step, as a slower machine would
    step_delay_until: str = ""  # a file: once it exists, faults.step_delay_s stops (a paced run's fault is over)
    weight_scale: float = 1.0  # this worker claims this x the samples it trained on as its contribution's weight
    poison_state: bool = False  # this worker offers peers its state with other params, claiming a group of 999
    corrupt_state_range: bool = False  # every part of its state this worker serves a downloading peer is corrupt


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
