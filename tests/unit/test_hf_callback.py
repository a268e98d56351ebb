"""``diloco.hf.DiLoCoCallback``: a real ``transformers.Trainer`` training a tiny Llama (built from
its config, nothing downloaded) as a DiLoCo worker (one worker, simulated transport): a round every
``outer.sync_every`` optimizer steps, the end record, a rerun resumed from diloco's checkpoint,
and a worker that leaves when ``trainer.train()`` raises."""

from __future__ import annotations

import gc
import itertools
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments, set_seed

import diloco
from diloco.core.digest import tensors_digest
from diloco.errors import UsageError, UserError
from diloco.hf import DiLoCoCallback
from diloco.worker.faults import StopRequested
from tests.conftest import read_records, round_records

pytestmark = pytest.mark.timeout(120)
VOCAB, BLOCK = 64, 16
_run_ids = itertools.count()


def _run(run_dir, *overrides: str, steps: int = 12, sync_every: int = 4) -> diloco.Run:
    return diloco.init(
        None,
        f"inner.steps={steps}",
        f"outer.sync_every={sync_every}",
        f"run.dir={run_dir}",
        f"comm.run_id=hf_callback_{next(_run_ids)}",  # the simulated transport's runs live in this process
        "comm.backend=simulator",
        "worker.device=cpu",
        "worker.threads=1",
        "logging.log_every=2",
        "checkpoint.every_rounds=1",
        *overrides,
    )


def _trainer(run_dir, *callbacks: TrainerCallback, max_steps: int = 12, save_strategy: str = "no", accumulate: int = 1):
    set_seed(0)  # every worker starts from the same model
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=BLOCK,
    )
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (72, BLOCK), generator=generator)
    data = [{"input_ids": ids, "labels": ids} for ids in tokens]
    args = TrainingArguments(
        output_dir=str(run_dir / "trainer"),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate,
        learning_rate=1e-3,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=20,  # the learning rate still rises at the run's end: never 0
        logging_steps=2,
        save_strategy=save_strategy,
        save_steps=4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    model = LlamaForCausalLM(config)
    return Trainer(model=model, args=args, train_dataset=data[:64], eval_dataset=data[64:], callbacks=list(callbacks))


class _FailAt(TrainerCallback):
    """An error inside trainer.train() at optimizer step ``step``, after the DiLoCo callback counted it."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("the user's loop failed")


def test_a_trainer_syncs_every_sync_every_optimizer_steps_and_writes_the_end_record(tmp_path):
    callback = DiLoCoCallback(_run(tmp_path), evaluate=lambda: trainer.evaluate()["eval_loss"])
    trainer = _trainer(tmp_path, callback, accumulate=2)  # a step: 2 batches of 4
    trainer.train()
    assert [(r["round"], r["step"]) for r in round_records(tmp_path, 0)] == [(1, 4), (2, 8), (3, 12)]
    assert all(isinstance(r["val_loss"], float) for r in round_records(tmp_path, 0))  # the Trainer's evaluation
    (end,) = [r for r in read_records(tmp_path, 0) if r["event"] == "end"]
    assert end["inner_steps"] == 12 and end["rounds"] == 3 and end["tokens"] == 12 * 8 and callback.result == end
    assert end["param_sha256"] == round_records(tmp_path, 0)[-1]["param_sha256"]
    steps = [r for r in read_records(tmp_path, 0) if r["event"] == "step" and "loss" in r]
    # the Trainer's logged loss, in diloco's records; at a round's end, too (its evaluation logs in between)
    assert [r["step"] for r in steps] == [2, 4, 6, 8, 10, 12]
    assert trainer.state.global_step == 12


def test_a_rerun_resumes_from_diloco_checkpoint_and_the_trainer_stops_at_inner_steps(tmp_path):
    straight = tmp_path / "straight"
    _trainer(straight, DiLoCoCallback(_run(straight))).train()
    stopped = tmp_path / "stopped"
    with pytest.raises(StopRequested), DiLoCoCallback(_run(stopped, "faults.stop_after_round=2")) as callback:
        _trainer(stopped, callback).train()  # "killed" after round 2's checkpoint

    resumed = _trainer(stopped, DiLoCoCallback(_run(stopped)))
    resumed.train()
    assert resumed.state.global_step == 4  # the run's steps 9-12, although the Trainer's max_steps is 12
    assert [r["round"] for r in round_records(stopped, 0)] == [1, 2, 3]
    (resume,) = [r for r in read_records(stopped, 0) if r["event"] == "resume"]
    assert resume["step"] == 8 and resume["round"] == 2, resume
    (end,) = [r for r in read_records(stopped, 0) if r["event"] == "end"]
    assert end["inner_steps"] == 12 and end["rounds"] == 3
    lrs = [
        {r["step"]: r.get("lr") for r in read_records(run, 0) if r["event"] == "step"} for run in (straight, stopped)
    ]
    assert lrs[1][10] == lrs[0][10] and lrs[1][12] == lrs[0][12]  # the scheduler went on from the checkpoint

    after_the_end = _trainer(stopped, DiLoCoCallback(_run(stopped)))
    after_the_end.train()  # the Trainer takes one step before it can stop: it changes nothing
    assert tensors_digest(list(after_the_end.model.parameters())) == end["param_sha256"]


def test_a_trainer_run_that_raises_leaves_the_run_in_the_with_form_and_without_it(tmp_path):
    with_form = tmp_path / "with"
    with pytest.raises(RuntimeError, match="the user's loop failed"), DiLoCoCallback(_run(with_form)) as callback:
        _trainer(with_form, callback, _FailAt(6)).train()
    assert callback.dl is None and callback.result is None
    assert [r["step"] for r in read_records(with_form, 0) if r["event"] == "step"][-1] == 6  # closed: its last record

    bare = tmp_path / "bare"
    callback = DiLoCoCallback(_run(bare))
    try:
        _trainer(bare, callback, _FailAt(6)).train()
    except RuntimeError:
        pass
    else:
        pytest.fail("trainer.train() did not raise")
    assert not any(r["event"] == "step" and r["step"] == 6 for r in read_records(bare, 0))  # still in the run
    del callback
    gc.collect()  # the Trainer and its callback collected: the worker leaves
    assert [r["step"] for r in read_records(bare, 0) if r["event"] == "step"][-1] == 6
    assert [r["round"] for r in round_records(bare, 0)] == [1]


def test_resuming_from_the_trainers_own_checkpoint_is_refused_in_one_line(tmp_path):
    _trainer(tmp_path, DiLoCoCallback(_run(tmp_path, steps=8)), max_steps=8, save_strategy="steps").train()
    trainer = _trainer(tmp_path, DiLoCoCallback(_run(tmp_path, steps=8)), max_steps=8)
    with pytest.raises(UsageError, match="rerun without resume_from_checkpoint, the worker resumes from"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "trainer" / "checkpoint-4"))


def test_without_transformers_the_module_says_how_to_install_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "diloco.hf")
    with pytest.raises(UserError, match=r"^diloco.hf needs the Hugging Face extra .*: pip install 'diloco\[hf\]'$"):
        import diloco.hf  # noqa: F401


def test_after_a_resume_off_the_logging_grid_the_trainers_loss_still_reaches_the_records(tmp_path):
    # rounds of 3 steps, a record every 2: resumed at step 3, the Trainer logs at its own steps 2, 4, ...
    with pytest.raises(StopRequested), DiLoCoCallback(_run(tmp_path, "faults.stop_after_round=1", sync_every=3)) as cb:
        _trainer(tmp_path, cb).train()
    _trainer(tmp_path, DiLoCoCallback(_run(tmp_path, sync_every=3))).train()
    after = [r for r in read_records(tmp_path, 0) if r["event"] == "step" and r["step"] > 3]
    assert [r["step"] for r in after if "loss" in r] == [5, 7, 9, 11], after
