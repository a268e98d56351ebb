"""``diloco.hf.DiLoCoCallback``: a Hugging Face ``transformers.Trainer`` as a DiLoCo worker.

    run = diloco.init()                                   # diloco launch's environment, a file or keywords
    set_seed(0); model = AutoModelForCausalLM.from_config(config)   # the same initial model on every worker
    args = TrainingArguments(..., max_steps=run.config.inner.steps, logging_steps=run.config.logging.log_every)
    trainer = Trainer(model, args, train_dataset=dataset.shard(run.data_count, run.data_index))
    with diloco.hf.DiLoCoCallback(run) as callback:      # or trainer.add_callback(callback) alone
        trainer.add_callback(callback)
        trainer.train()

The Trainer's optimizer is the inner one. When training begins (``on_train_begin``: the first event
that has the optimizer and the learning-rate scheduler) the callback enters ``diloco.DiLoCo``
(worker/wrapper.py) around the Trainer's model and optimizer, with the scheduler checkpointed beside
them; it counts each optimizer step (``on_step_end``, once per step after gradient accumulation):
every ``outer.sync_every`` steps the worker averages with the run's other workers, takes the outer
step, writes its round record and checkpoints. The Trainer's logged loss goes into the step records
(``on_log``). At ``on_train_end`` the worker leaves the run as ``diloco train``'s does (``result``:
its end record).

- The run's length is ``inner.steps``: the callback stops the Trainer there. A Trainer whose
  ``max_steps`` (or epochs) ends first leaves the run early, its part-done round averaged; the
  callback says so in one line when training begins.
- Rerunning the script resumes from diloco's newest checkpoint (``checkpoint.every_rounds``): the
  model, the optimizer, the scheduler and the run's step and round; the Trainer counts its own
  steps from 0 again and its data loader starts its epoch over. The Trainer's own checkpoints
  (``save_strategy``) are still written, but hold no outer state: ``trainer.train(
  resume_from_checkpoint=...)`` under the callback is refused in one line.
- One Trainer process is one worker: not under torchrun, nor as a site's ranks (refused in one line).
- An error inside ``trainer.train()`` skips ``on_train_end``: leaving the ``with`` block then tells
  the run the worker left, at once; without it, that happens when the callback is collected or at
  the interpreter's exit.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from diloco.errors import ConfigError, UsageError, UserError
from diloco.optional_deps import import_hf
from diloco.worker.run import Run
from diloco.worker.wrapper import DiLoCo

_transformers = import_hf("transformers", needed_for="diloco.hf", error=UserError)
logger = logging.getLogger(__name__)


class DiLoCoCallback(_transformers.TrainerCallback):
    """The Trainer's training as worker ``run.worker_index`` of ``run``. ``evaluate`` and ``state``
    are ``DiLoCo``'s (the scheduler is checkpointed without being named); ``samples_per_step``
    defaults to the Trainer's batch size times its gradient accumulation steps."""

    def __init__(
        self,
        run: Run,
        *,
        evaluate: Callable[[], float | None] | None = None,
        state: dict[str, Any] | None = None,
        samples_per_step: int | None = None,
        tokens_per_step: int | None = None,
    ):
        self.run, self.evaluate, self.state = run, evaluate, dict(state or {})
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self.dl: DiLoCo | None = None  # while training
        self.result: dict | None = None  # the end record, once training ended normally
        self._leave_on_exit: weakref.finalize | None = None

    # ---- the with form: leave the run even when trainer.train() raises -------------------------
    def __enter__(self) -> DiLoCoCallback:
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        self._leave(exc_type or RuntimeError, exc, traceback)  # training that reached on_train_end has left
        return False

    # ---- the Trainer's events ----------------------------------------------------------------
    def on_train_begin(self, args, state, control, *, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.dl is not None:
            raise UsageError("a DiLoCoCallback trains once: make a new one (with a new diloco.init()) for another run")
        if state.global_step > 0:
            raise UsageError(
                f"the Trainer resumed from its own checkpoint (step {state.global_step}), which holds no DiLoCo "
                f"state: rerun without resume_from_checkpoint, the worker resumes from {self.run.run_dir}/checkpoints"
            )
        if args.world_size > 1 or self.run.placement.ranks > 1:
            raise ConfigError(
                "DiLoCoCallback trains one Trainer process per worker (not under torchrun, not as a site's "
                "ranks): start each worker as its own process (diloco launch)"
            )
        if args.device.type != self.run.device.type:
            raise ConfigError(
                f"worker.device={self.run.config.worker.device} is {self.run.device.type} but the Trainer trains "
                f"on {args.device.type}: set worker.device={args.device.type}"
            )
        extra = {"lr_scheduler": lr_scheduler} if lr_scheduler is not None else {}
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
        dl = DiLoCo(
            self.run,
            model,
            optimizer,
            evaluate=self.evaluate,
            state={**extra, **self.state},
            hook=False,  # counted at on_step_end: after the scheduler's step, which the checkpoint holds
            samples_per_step=self.samples_per_step or batch,
            tokens_per_step=self.tokens_per_step,
        )
        dl.__enter__()  # a failure here leaves nothing to close: DiLoCo closed what it started
        self.dl = dl
        self._leave_on_exit = weakref.finalize(self, _leave_on_error, dl)
        self._tell_length(state.max_steps)
        if not self.dl.running:  # resumed after the run's end
            control.should_training_stop = True

    def on_pre_optimizer_step(self, args, state, control, *, model=None, **kwargs):
        dl = self._training("on_pre_optimizer_step")
        if not dl.running:  # the run had ended before this step (resumed after its end): it changes nothing
            model.zero_grad(set_to_none=True)
        elif dl.average_gradients is not None:  # the data-parallel baseline, after the Trainer's clipping
            dl.average_gradients()

    def on_step_end(self, args, state, control, **kwargs):
        dl = self._training("on_step_end")
        if dl.running:
            flags = dict(vars(control))
            # the Trainer logs this step (control.should_log, set before us): its record takes the loss
            dl.after_step(record=control.should_log)  # a round's end: average, outer step, record, checkpoint
            vars(control).update(flags)  # as the step left them: an evaluate() by trainer.evaluate() resets them
        if not dl.running:
            control.should_training_stop = True

    def on_log(self, args, state, control, *, logs=None, **kwargs):
        if self.dl is None or not logs or "loss" not in logs:  # an evaluation's, or the final summary's
            return
        names = {"loss": "loss", "learning_rate": "lr", "grad_norm": "grad_norm"}
        self.dl.log(**{name: logs[key] for key, name in names.items() if logs.get(key) is not None})

    def on_train_end(self, args, state, control, **kwargs):
        dl, self.dl = self.dl, None
        if dl is None:
            return
        self._leave_on_exit.detach()
        dl.__exit__(None, None, None)  # a part-done round is averaged, late peers waited for, the end record written
        self.result = dl.result

    # ---- inside ------------------------------------------------------------------------------
    def _training(self, event: str) -> DiLoCo:
        if self.dl is None:
            raise UsageError(f"DiLoCoCallback.{event} before on_train_begin: add the callback before trainer.train()")
        return self.dl

    def _leave(self, exc_type, exc, traceback) -> None:
        dl, self.dl = self.dl, None
        if dl is not None:
            self._leave_on_exit.detach()
            dl.__exit__(exc_type, exc, traceback)

    def _tell_length(self, max_steps: int) -> None:
        """One line when the Trainer's steps and the run's left differ."""
        cfg, done = self.run.config, self.dl.inner_steps
        if cfg.outer.round_s or max_steps == cfg.inner.steps - done:
            return
        if max_steps > cfg.inner.steps - done:
            logger.info(
                "the Trainer stops at inner.steps=%d (step %d of the run now; its max_steps=%d counts this process's)",
                cfg.inner.steps,
                done,
                max_steps,
            )
        else:
            logger.warning(
                "the Trainer's max_steps=%d ends before inner.steps=%d (step %d of the run now): "
                "this worker leaves the run early; set max_steps=run.config.inner.steps",
                max_steps,
                cfg.inner.steps,
                done,
            )


def _leave_on_error(dl: DiLoCo) -> None:
    """Training never reached on_train_end (an error, Ctrl-C): tell the run the worker left."""
    dl.__exit__(RuntimeError, None, None)
