"""``diloco.DiLoCo``: DiLoCo around a model, its inner optimizer and the user's own loop.

    run = diloco.init()
    with diloco.DiLoCo(run, model, inner_optimizer) as dl:
        while dl.running:                         # inner.steps of the run's config
            loss = model(batch); loss.backward(); inner_optimizer.step(); inner_optimizer.zero_grad()
            dl.log(loss=loss)                     # optional: records, wandb, diloco status

A hook on the inner optimizer's ``step`` counts inner steps (``hook=False``: the loop calls
``dl.after_step()`` after each instead). At each round's end, every ``outer.sync_every`` steps
(or ``outer.round_s`` seconds), the worker averages its pseudo-gradient with the run's other
workers and takes the outer step (how rounds sync: sync_modes.py; the outer step: core/outer.py;
after a failed or partial round: core/recovery.py), evaluates (``evaluate``, or ``batch_losses``:
the workers holding the same params then split the held-out batches, core/shared_evaluation.py),
writes its round record and checkpoints (round_end.py). Entering resumes from the worker's
newest checkpoint (the model, the inner optimizer, ``state``'s objects and ours) and catches up
with a live run rounds ahead; leaving ends the worker's run as ``diloco train`` ends one: a round
left part-done is averaged with the others, then it waits for late peers and writes its end record
(``dl.result``). An error inside the loop (or Ctrl-C) leaves at once: the worker tells the run it
left, and its newest checkpoint stays.

``diloco train`` is this wrapper's first user (train.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from diloco.errors import UsageError
from diloco.lifetime import sigterm_as_interrupt
from diloco.worker.build import OWN_PARTS, Worker, build_worker
from diloco.worker.faults import slow_down
from diloco.worker.held_out import HeldOutLoss
from diloco.worker.resume import Resume
from diloco.worker.round_end import RoundEnds
from diloco.worker.run import Run

# what a step record holds of its own: no figure of the loop's may take these names
RECORD_FIELDS = ("event", "step", "round", "tokens_per_s", "time_s")


class DiLoCo:
    """The DiLoCo worker of ``run`` around ``model`` and ``inner_optimizer``, as a context manager.

    ``evaluate()``: called after each round, its validation loss goes into the round record.
    ``batch_losses(indices)`` with ``eval_batches``: the losses of those of the ``eval_batches``
    held-out batches, in order; the round's loss is their mean over all, and workers that hold the
    same params split the batches between them where the transport offers it (``evaluate``, when
    also given, serves where they are not split).
    ``state``: more objects with ``state_dict``/``load_state_dict`` (a data loader's position, a
    learning-rate scheduler) to checkpoint with the model. ``samples_per_step``: a step's weight
    in the average (default ``inner.batch_size``); ``tokens_per_step``: what the throughput counts
    (default: the samples). ``on_ready(addresses)``: once the worker is reachable by peers.
    """

    def __init__(
        self,
        run: Run,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        evaluate: Callable[[], float | None] | None = None,
        batch_losses: Callable[[list[int]], Sequence[float]] | None = None,
        eval_batches: int = 0,
        state: dict[str, Any] | None = None,
        hook: bool = True,
        samples_per_step: int | None = None,
        tokens_per_step: int | None = None,
        on_ready: Callable[[list[str]], None] | None = None,
    ):
        self.run, self.model, self.inner_optimizer = run, model, inner_optimizer
        self.hook, self.on_ready = hook, on_ready
        self.held_out = HeldOutLoss(evaluate, batch_losses, eval_batches)
        self.state = _checked_state(state or {})
        self.samples_per_step = samples_per_step or run.config.inner.batch_size
        self.tokens_per_step = tokens_per_step or self.samples_per_step
        self._rounds = RoundEnds(run, self.held_out, samples_per_step=self.samples_per_step)
        self.result: dict | None = None  # the end record, once the context is left normally
        self._worker: Worker | None = None
        self._entered = False
        self._step_started = 0.0
        self._shapes: list[tuple[int, ...]] = []
        self._hooks: list = []
        self._sigterm = contextlib.ExitStack()  # SIGTERM as Ctrl-C inside the block

    # ---- the context -----------------------------------------------------------------------
    def __enter__(self) -> DiLoCo:
        if self._entered:
            raise UsageError("a DiLoCo is entered once: make a new one for another run")
        self._entered = True
        cfg = self.run.config
        synced = self.run.synced_params(self.model)
        _check_optimizer(self.model, self.inner_optimizer)
        self._shapes = [tuple(p.shape) for p in synced]
        worker = build_worker(
            cfg,
            self.run.placement,
            self.model,
            self.inner_optimizer,
            synced_params=synced,
            extra=self.state,
            samples_per_step=self.samples_per_step,
            tokens_per_step=self.tokens_per_step,
            join=self.run.join,
        )
        self._worker = worker
        self._sigterm.enter_context(sigterm_as_interrupt())  # a launcher's SIGTERM leaves as Ctrl-C does
        try:
            if self.on_ready is not None:
                self.on_ready(worker.backend.membership.addresses)
            self._rounds.begin_at(*worker.begin())  # resumed, or caught up with a run rounds ahead
            if self.hook:
                self._hooks = self._register_hooks()
        except BaseException:
            self._worker = None
            self._sigterm.close()
            worker.close()
            raise
        worker.clock.start_round()
        worker.watchdog.enter("training")
        self._step_started = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        worker = self._worker
        if worker is None:
            return False
        try:
            if exc_type is None:
                self.result = self._finish(worker)
        finally:
            for handle in self._hooks:
                handle.remove()
            self._worker = None
            self._sigterm.close()
            worker.close()  # a worker leaving on an error or Ctrl-C tells the run at once
        return False

    # ---- what the loop reads ---------------------------------------------------------------
    @property
    def inner_steps(self) -> int:
        """Inner steps this worker has taken over the run (a resumed one: from its checkpoint)."""
        return self._rounds.inner_steps

    @property
    def round(self) -> int:
        """Rounds ended."""
        return self._rounds.round

    @property
    def params_digest(self) -> str | None:
        """The synced params' digest after the latest round."""
        return self._rounds.params_digest

    @property
    def val_loss(self) -> float | None:
        """The held-out loss after the latest round."""
        return self._rounds.val_loss

    @property
    def running(self) -> bool:
        """Whether the worker has inner steps left (``inner.steps``; with ``outer.round_s``, rounds)."""
        return self._active("running").clock.running(self.inner_steps, self.round)

    @property
    def schedule_step(self) -> int:
        """The step a learning-rate schedule should see for the next inner step (with
        ``outer.round_s``, the round's elapsed time: core/rounds.py)."""
        return self._active("schedule_step").clock.schedule_step(self.inner_steps, self.round)

    @property
    def average_gradients(self) -> Callable[[], None] | None:
        """Between backward and the update: a site's gradient averaging, or the data-parallel
        baseline's (``outer.sync_every=0``); None otherwise. With ``hook`` it runs as a pre-hook
        of the inner optimizer's ``step``."""
        return self._active("average_gradients").average_gradients

    @property
    def model_is_synced(self) -> bool:
        """After a round, whether the model holds exactly the synced params (not with overlapped rounds)."""
        return self._active("model_is_synced").sync.model_is_synced

    @property
    def resumed(self) -> Resume:
        """Where the worker's state came from (resume.py)."""
        return self._active("resumed").resume

    # ---- what the loop calls ---------------------------------------------------------------
    def after_step(self, *, record: bool | None = None) -> None:
        """With ``hook=False``: one inner step was taken; count it, and end the round when it is due.
        ``record``: whether the step's record is due (default: every ``logging.log_every`` steps)."""
        self._active("after_step")
        if self.hook:
            raise UsageError(
                "dl.after_step() with hook=True would count each step twice: the hook on the inner optimizer's "
                "step counts it; pass hook=False to DiLoCo to count steps with dl.after_step()"
            )
        self._count_step(record)

    def _count_step(self, record: bool | None) -> None:
        worker, cfg = self._active("after_step"), self.run.config
        if not worker.clock.running(self.inner_steps, self.round):
            raise UsageError(
                f"inner step {self.inner_steps + 1} is past the run's end (inner.steps={cfg.inner.steps}): "
                f"loop while dl.running, or set inner.steps to the steps the loop takes"
            )
        slow_down(cfg.faults, cfg.worker.index)  # faults.step_delay_s: as on a slower machine
        step_s = time.perf_counter() - self._step_started
        self._rounds.count_step()
        worker.backend.membership.report_progress(self.round, self.inner_steps, worker.log.live)
        worker.sync.after_inner_step(self.inner_steps, step_s)  # overlapped: syncs start and land
        due = self.inner_steps % cfg.logging.log_every == 0 if record is None else record
        worker.log.count_step(self.inner_steps, self.round, due=due)
        if worker.clock.round_ends(self.inner_steps):
            self._end_round(worker)
        worker.watchdog.enter("training")
        self._step_started = time.perf_counter()

    def log(self, **figures) -> None:
        """The latest step's figures (``loss=``, ``lr=``, anything numeric): into its record when
        one is due (every ``logging.log_every`` steps), wandb and ``diloco status``. Tensors are
        read only then. Without an ``lr`` the inner optimizer's first group's is recorded."""
        worker = self._active("log")
        if taken := [name for name in figures if name in RECORD_FIELDS]:
            raise UsageError(f"dl.log({taken[0]}=...): {taken[0]!r} is a field of the record itself; name it otherwise")
        if "lr" not in figures and self.inner_optimizer.param_groups:
            figures["lr"] = self.inner_optimizer.param_groups[0].get("lr")
        worker.log.write_step(figures)

    # ---- rounds ----------------------------------------------------------------------------
    def _end_round(self, worker: Worker, *, last: bool = False) -> None:
        """The round's end (round_end.py), once the model's params are checked."""
        self._check_params()
        self._rounds.end_round(worker, last=last)

    def _finish(self, worker: Worker) -> dict:
        """The loop is over: a round left part-done is averaged with the others where the model
        holds the synced params; then the worker's run ends (round_end.py)."""
        if self._rounds.samples_this_round and worker.sync.model_is_synced:  # stopped before inner.steps
            self._end_round(worker, last=True)
        return self._rounds.finish(worker)

    # ---- checks and hooks ------------------------------------------------------------------
    def _active(self, what: str) -> Worker:
        if self._worker is None:
            raise UsageError(f"dl.{what} is used outside `with DiLoCo(...) as dl:`: use it inside the block")
        return self._worker

    def _check_params(self) -> None:
        """The model's params are those the worker started with, of the same shapes."""
        if self.run.placement.ranks > 1:
            return  # a site's ranks hold shards, checked by the site
        now = [tuple(p.shape) for p in self.model.parameters()]
        if now != self._shapes:
            raise UsageError(
                f"the model's parameters changed after DiLoCo started ({len(self._shapes)} params, now {len(now)}; "
                f"shapes differ): build the whole model before entering DiLoCo, and keep it"
            )

    def _register_hooks(self) -> list:
        optimizer = self.inner_optimizer
        if not hasattr(optimizer, "register_step_post_hook"):
            raise UsageError(
                f"{type(optimizer).__name__} has no step hooks: pass hook=False to DiLoCo and call "
                f"dl.after_step() after each inner step"
            )
        hooks = [optimizer.register_step_post_hook(self._after_optimizer_step)]
        if self.average_gradients is not None:
            hooks.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
        return hooks

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._count_step(None)

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        self.average_gradients()


def _checked_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state``, refused in one line when a name is one of the checkpoint's own or an object
    cannot be checkpointed."""
    for name, item in state.items():
        if name in OWN_PARTS:
            raise UsageError(
                f"state={{{name!r}: ...}}: {name!r} is a part of diloco's own checkpoint; pick another name"
            )
        if not (callable(getattr(item, "state_dict", None)) and callable(getattr(item, "load_state_dict", None))):
            raise UsageError(
                f"state={{{name!r}: ...}}: a {type(item).__name__} has no state_dict()/load_state_dict(); "
                f"pass objects that have both"
            )
    return dict(state)


def _check_optimizer(model: nn.Module, optimizer) -> None:
    """The inner optimizer steps the model's own params (a sharded site: its shards, placed first)."""
    params = {id(p) for p in model.parameters()}
    stepped = [p for group in getattr(optimizer, "param_groups", []) for p in group.get("params", [])]
    if stepped and not all(id(p) in params for p in stepped):
        raise UsageError(
            "the inner optimizer steps params that are not the model's: build it from model.parameters() "
            "after run.place(model)"
        )
