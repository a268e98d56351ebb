"""A Hugging Face ``Trainer`` script as a DiLoCo worker: a tiny Llama (built from its config, random
init) learns tinyshakespeare byte by byte, and ``diloco.hf.DiLoCoCallback`` makes every
``outer.sync_every`` optimizer steps a round with the run's other workers. Needs the hf extra
(pip install 'diloco[hf]'); nothing is downloaded.

    diloco launch --workers 2 -- python examples/hf_trainer.py    # 2 workers over hivemind
    python examples/hf_trainer.py                                  # one worker alone
    python examples/hf_trainer.py inner.steps=40 outer.sync_every=10 run.dir=/tmp/hf-run   # KEY=VALUE overrides

Each worker trains on its own share of the text (``run.data_index`` of ``run.data_count``) and
evaluates on the held-out tail every worker shares (the ``val_loss`` of its round records).
Rerunning the same command resumes from diloco's newest checkpoint. Worker 0 saves the final
model to ``<run.dir>/model``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, set_seed

import diloco
import diloco.hf

TEXT = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare.txt"
BLOCK = 64  # tokens (bytes) a training example holds
HELD_OUT = 32  # examples at the text's end, the same on every worker


def examples(text: Path, share: int, shares: int) -> tuple[list[dict], list[dict]]:
    """(this worker's training examples: its contiguous share of the text, the held-out examples)."""
    tokens = torch.frombuffer(bytearray(text.read_bytes()), dtype=torch.uint8).long()
    blocks = tokens[: len(tokens) // BLOCK * BLOCK].view(-1, BLOCK)
    train, held_out = blocks[:-HELD_OUT], blocks[-HELD_OUT:]
    per_share = len(train) // shares
    mine = train[share * per_share : (share + 1) * per_share]
    return [{"input_ids": ids, "labels": ids} for ids in mine], [{"input_ids": ids, "labels": ids} for ids in held_out]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    # the script's defaults, under its command line's KEY=VALUE overrides and diloco launch's
    run = diloco.init(
        None,
        *sys.argv[1:],
        inner={"steps": 200, "batch_size": 8, "lr": 1e-3},
        outer={"sync_every": 20},
        run={"dir": "runs/example-hf-trainer"},
        logging={"log_every": 10},
    )
    cfg = run.config
    set_seed(cfg.seed)  # the same initial model on every worker
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=BLOCK,
            tie_word_embeddings=False,
        )
    )
    train, held_out = examples(TEXT, run.data_index, run.data_count)
    args = TrainingArguments(
        output_dir=str(cfg.run_dir / f"trainer-{run.worker_index}"),
        max_steps=cfg.inner.steps,  # the run's length: the callback would stop the Trainer there anyway
        per_device_train_batch_size=cfg.inner.batch_size,
        per_device_eval_batch_size=HELD_OUT,
        learning_rate=cfg.inner.lr,
        warmup_steps=cfg.inner.warmup_steps,
        logging_steps=cfg.logging.log_every,  # its loss goes into diloco's step records
        save_strategy="no",  # diloco checkpoints every checkpoint.every_rounds rounds: rerunning resumes
        report_to=[],
        use_cpu=run.device.type == "cpu",
        disable_tqdm=True,
        seed=cfg.seed + run.worker_index,  # each worker its own data order
    )
    callback = diloco.hf.DiLoCoCallback(
        run,
        evaluate=lambda: trainer.evaluate()["eval_loss"],  # after each round: its record's val_loss
        tokens_per_step=cfg.inner.batch_size * BLOCK,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=held_out, callbacks=[callback])
    with callback:  # an error inside train() leaves the run at once
        trainer.train()
    if run.worker_index == 0:
        trainer.save_model(str(cfg.run_dir / "model"))
    end = callback.result
    print(
        f"worker {run.worker_index}: {end['inner_steps']} steps, {end['rounds']} rounds, val_loss {end['val_loss']:.4f}"
    )


if __name__ == "__main__":
    main()
