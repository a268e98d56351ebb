"""The schema: ``Config`` composed from each section's dataclass, which lives beside the code it
configures (``ModelConfig`` in models/gpt.py, ``OuterConfig`` in core/outer.py, ...); the run and
worker sections, which belong to no one module, are here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from diloco.comm import CommConfig
from diloco.compression import CompressionConfig
from diloco.core.inner import InnerConfig
from diloco.core.outer import OuterConfig
from diloco.data.source import DataConfig
from diloco.models.gpt import ModelConfig
from diloco.worker.checkpoint import CheckpointConfig
from diloco.worker.faults import FaultConfig
from diloco.worker.metrics import LoggingConfig

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
    gpu_memory_fraction: float = 0.0  # the most of its GPU's memory this worker may take; 0 = all (diloco local: 1/M)

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
