"""What ``diloco train`` trains, built from its config: this worker's shard of the corpus, the
held-out batches every worker shares, its GPT or Hugging Face model and its inner optimizer.
train.py runs them inside ``DiLoCo`` (wrapper.py), as a user's own script does with its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diloco.config import Config
from diloco.core.digest import tensors_digest
from diloco.core.inner import build_inner_optimizer
from diloco.data.corpus import ShardSampler, load_corpus, val_batches
from diloco.models.gpt import build_model
from diloco.worker.memory import check_model_fits
from diloco.worker.resume import Resume
from diloco.worker.run import Run


@dataclass
class LanguageModelTask:
    """One worker's data, model and inner optimizer (the same initial params on every worker)."""

    sampler: ShardSampler  # this worker's shard of the train split
    held_out: list  # the held-out batches every worker shares
    held_out_hash: str
    model: torch.nn.Module
    inner_optimizer: torch.optim.Optimizer

    def follow(self, resume: Resume) -> None:
        """After a resume from another worker's checkpoint: this worker's data position rebuilt on
        its own shard as far along as the other's (its own checkpoint restored its own already)."""
        if resume.state is not None and not resume.own:
            self.sampler.skip(resume.state["sampler"]["batches_drawn"])

    @property
    def samples_per_step(self) -> int:
        """Sequences per inner step, over a site's ranks."""
        return self.sampler.batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.sampler.batch_size * self.sampler.block_size


def build_task(run: Run) -> LanguageModelTask:
    """``run``'s data, model (placed: on a sharded site, sharded before the optimizer is built)
    and inner optimizer; refused at once when the model cannot fit (memory.py)."""
    cfg = run.config
    sampler, held_out, vocab_size = _data(cfg, ranks=run.placement.ranks)
    check_model_fits(
        cfg.model,
        vocab_size=vocab_size,
        device=run.device,
        batch_size=cfg.inner.batch_size,
        precision=cfg.worker.precision,
        global_on_gpu=cfg.outer.global_device == "model",
        gpu_share=cfg.worker.gpu_memory_fraction,
    )
    torch.manual_seed(cfg.seed)
    model = run.place(build_model(cfg.model, vocab_size=vocab_size))
    inner_optimizer = build_inner_optimizer(cfg.inner, model)
    if cfg.worker.compile:  # in place, after the optimizer: same params, same state_dict keys
        model.compile()
    torch.manual_seed(cfg.seed * 1000 + cfg.worker.index)  # dropout differs per worker
    return LanguageModelTask(sampler, held_out, tensors_digest(x for x, _ in held_out), model, inner_optimizer)


def _data(cfg: Config, *, ranks: int) -> tuple[ShardSampler, list, int]:
    """This worker's shard of the train split, the held-out batches every worker shares, and the
    corpus's vocabulary size."""
    corpus = load_corpus(cfg.data)
    sampler = ShardSampler(
        corpus.train,
        block_size=cfg.model.block_size,
        batch_size=cfg.inner.batch_size * ranks,  # a site draws one batch for all its ranks; each takes its slice
        shard_index=cfg.worker.index,
        num_shards=cfg.worker.shards,
        seed=cfg.seed,
        chunk=cfg.data.shard_chunk,
    )
    return sampler, held_out_batches(cfg, corpus.val), corpus.vocab_size


def held_out_batches(cfg: Config, val: torch.Tensor) -> list:
    """The held-out batches every worker of the run evaluates, drawn from the corpus's ``val`` split."""
    return val_batches(
        val,
        block_size=cfg.model.block_size,
        batch_size=cfg.logging.eval_batch_size,
        num_batches=cfg.logging.eval_batches,
        seed=cfg.seed,
    )
