"""``diloco bench overhead``: the worker's inner-step throughput against a bare PyTorch loop.

Three arms run in this process, alternately, on the same model ("baby"), batch, data sampler
and AdamW with clipping:

- bare: the plain loop;
- library: the same loop inside ``diloco.DiLoCo`` (its hook on the optimizer's step), timed as
  the bare loop is: what a user's own loop pays for the library;
- worker: ``diloco train``'s loop (one worker, no sync until the end), its throughput read from the
  timestamps of its own step records, so everything it does per step (schedule, timing,
  logging) is counted.

Target: each >= 0.97 x bare.

    diloco bench overhead --steps 60 --repeats 5
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from diloco.config import load_config
from diloco.core.inner import build_inner_optimizer
from diloco.data.corpus import ShardSampler, load_corpus
from diloco.models.gpt import build_model

WARMUP_STEPS = 10


def _bare_loop(cfg):
    """(model, optimizer, one step of the bare loop)."""
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(cfg.data)
    model = build_model(cfg.model, vocab_size=corpus.vocab_size)
    optimizer = build_inner_optimizer(cfg.inner, model)
    sampler = ShardSampler(
        corpus.train,
        block_size=cfg.model.block_size,
        batch_size=cfg.inner.batch_size,
        shard_index=0,
        num_shards=1,
        seed=cfg.seed,
    )

    def step() -> None:
        x, y = sampler.next_batch()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, optimizer, step


def _timed_tokens_per_s(cfg, step, steps: int) -> float:
    for _ in range(WARMUP_STEPS):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * cfg.inner.batch_size * cfg.model.block_size / (time.perf_counter() - started)


def _bare_loop_tokens_per_s(cfg, steps: int) -> float:
    return _timed_tokens_per_s(cfg, _bare_loop(cfg)[2], steps)


def _library_tokens_per_s(cfg, steps: int, run_dir: Path) -> float:
    """The bare loop inside ``DiLoCo``; its one round comes after the timed steps (on leaving)."""
    from diloco.worker.run import Run
    from diloco.worker.wrapper import DiLoCo

    cfg = replace(cfg, run=replace(cfg.run, dir=str(run_dir)), inner=replace(cfg.inner, steps=cfg.inner.steps + 1))
    model, optimizer, step = _bare_loop(cfg)
    with DiLoCo(Run.from_config(cfg), model, optimizer, tokens_per_step=cfg.inner.batch_size * cfg.model.block_size):
        return _timed_tokens_per_s(cfg, step, steps)


def _worker_tokens_per_s(cfg, steps: int, run_dir: Path) -> float:
    from diloco.worker.train import train

    cfg.run.dir = str(run_dir)
    train(cfg)
    records = [json.loads(line) for line in (run_dir / "worker-0.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time_s"] for r in records if r["event"] == "step"}
    first, last = WARMUP_STEPS, WARMUP_STEPS + steps
    return steps * cfg.inner.batch_size * cfg.model.block_size / (times[last] - times[first])


def run_overhead_benchmark(*, steps: int = 60, repeats: int = 5) -> int:
    steps = max(10, steps // 10 * 10)  # step records come every 10 steps
    overrides = [
        f"inner.steps={WARMUP_STEPS + steps}",
        f"outer.sync_every={WARMUP_STEPS + steps}",
        "logging.log_every=10",
        "logging.eval_batches=1",
        "checkpoint.every_rounds=0",
        "data.max_bytes=1000000",
        "worker.threads=" + str(torch.get_num_threads()),
    ]
    bare, library, worker = [], [], []
    print(
        f"overhead: model baby, batch 12 x 64, {steps} timed steps, {repeats} repeats, "
        f"{torch.get_num_threads()} threads"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            cfg = load_config(None, overrides)
            bare.append(_bare_loop_tokens_per_s(cfg, steps))
            library.append(_library_tokens_per_s(cfg, steps, Path(tmp) / f"l{repeat}"))
            worker.append(_worker_tokens_per_s(cfg, steps, Path(tmp) / f"w{repeat}"))
            print(
                f"  repeat {repeat + 1}: bare {bare[-1]:8.0f} tok/s   library {library[-1]:8.0f} tok/s "
                f"(x{library[-1] / bare[-1]:.3f})   worker {worker[-1]:8.0f} tok/s (x{worker[-1] / bare[-1]:.3f})",
                flush=True,
            )
    print(f"median: bare {statistics.median(bare):.0f} tok/s")
    for name, arm in (("library", library), ("worker", worker)):
        ratio = statistics.median([a / b for a, b in zip(arm, bare)])
        print(f"  {name}: {statistics.median(arm):.0f} tok/s, {name} / bare = {ratio:.3f} (target >= 0.97)")
    return 0


def add_arguments(parser) -> None:
    """``diloco bench overhead``'s flags."""
    parser.add_argument("--steps", type=int, default=150, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=7)


def main(args) -> int:
    return run_overhead_benchmark(steps=args.steps, repeats=args.repeats)
