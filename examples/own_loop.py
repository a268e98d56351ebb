"""Your own model and loop under DiLoCo: a small MLP learns to tell the arms of a spiral apart.

    python examples/own_loop.py                                          # one worker, runs/own-loop
    python examples/own_loop.py inner.steps=400 outer.sync_every=50      # KEY=VALUE settings of its own
    diloco launch --workers 4 -- python examples/own_loop.py             # 4 workers on this machine
    diloco launch --workers 4 outer.sync_every=50 -- python examples/own_loop.py   # the launcher's settings win

The data is made here from a fixed seed, the same on every worker; each worker trains on its own
shard of it (``run.data_index`` of ``run.data_count``) and every worker evaluates on the same
held-out points. Rerunning the same command resumes from the newest checkpoint in the run
directory. At the end worker 0 prints the final params' sha256 (every worker holds the same);
the loss curve is in RUN_DIR/worker-<i>.jsonl (``diloco plot RUN_DIR --out curve.png``).
"""

import logging
import math
import sys

import torch
from torch import nn

import diloco

ARMS, POINTS, HELD_OUT = 4, 16384, 2048


def spiral(count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` noisy 2-D points on ARMS interleaved spiral arms, and each point's arm."""
    labels = torch.randint(ARMS, (count,), generator=generator)
    radius = torch.rand(count, generator=generator)
    angle = 2 * math.pi * radius + 2 * math.pi * labels / ARMS
    points = radius[:, None] * torch.stack([angle.cos(), angle.sin()], dim=1)
    return points + 0.03 * torch.randn(count, 2, generator=generator), labels


class Batches:
    """Random batches of one worker's shard; its position (the generator) is checkpointed."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):
        self.x, self.y, self.batch_size = x, y, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(len(self.x), (self.batch_size,), generator=self.generator)
        return self.x[index], self.y[index]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")  # progress lines
    # this script's defaults (keywords) <- its command line's KEY=VALUE <- diloco launch's KEY=VALUE
    run = diloco.init(
        None,  # no config file of its own
        *sys.argv[1:],
        run={"name": "own-loop"},
        inner={"steps": 200, "batch_size": 64, "lr": 0.01, "warmup_steps": 20},
        outer={"sync_every": 20},
        logging={"log_every": 10},
    )
    cfg = run.config

    x, y = spiral(POINTS + HELD_OUT, torch.Generator().manual_seed(1234))  # the same data on every worker
    held_x, held_y = x[:HELD_OUT].to(run.device), y[:HELD_OUT].to(run.device)
    shard = slice(HELD_OUT + run.data_index, None, run.data_count)  # this worker's share of the rest
    batches = Batches(x[shard], y[shard], cfg.inner.batch_size, seed=cfg.seed * 1000 + run.data_index)

    torch.manual_seed(cfg.seed)  # every worker must start from the same params
    model = run.place(nn.Sequential(nn.Linear(2, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, ARMS)))
    inner = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr, weight_decay=cfg.inner.weight_decay)
    loss_fn = nn.CrossEntropyLoss()

    @torch.no_grad()
    def evaluate() -> float:
        return loss_fn(model(held_x), held_y).item()

    def lr_at(step: int) -> float:  # linear warm-up, then cosine decay to a tenth, over the run
        if step < cfg.inner.warmup_steps:
            return cfg.inner.lr * (step + 1) / cfg.inner.warmup_steps
        progress = (step - cfg.inner.warmup_steps) / max(1, cfg.inner.steps - cfg.inner.warmup_steps)
        return cfg.inner.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))

    with diloco.DiLoCo(run, model, inner, evaluate=evaluate, state={"batches": batches}) as dl:
        while dl.running:  # inner.steps in all; every outer.sync_every steps a round ends inside inner.step()
            for group in inner.param_groups:
                group["lr"] = lr_at(dl.schedule_step)
            xb, yb = batches.next()
            loss = loss_fn(model(xb.to(run.device)), yb.to(run.device))
            loss.backward()
            inner.step()
            inner.zero_grad()
            dl.log(loss=loss)

    if run.worker_index == 0:
        end = dl.result
        with torch.no_grad():
            accuracy = (model(held_x).argmax(dim=1) == held_y).float().mean().item()
        print(f"{end['inner_steps']} steps, {end['rounds']} rounds, val loss {end['val_loss']:.4f}")
        print(f"held-out accuracy {accuracy:.3f}")
        print(f"params sha256 {end['param_sha256']}")
        print(f"records: {run.run_dir}/worker-*.jsonl")


if __name__ == "__main__":
    main()
