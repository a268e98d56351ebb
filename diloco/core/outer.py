"""The outer step: pseudo-gradients, their average across workers, and the outer optimizer.

Every ``outer.sync_every`` inner steps a worker computes its pseudo-gradient (the global
params at the start of the round minus its local params now), averages it with the other
workers through the transport's ``Averaging``, writes the average into ``.grad`` of the global copy and
steps the outer optimizer, a plain ``torch.optim.Optimizer`` (DiLoCo, arXiv:2311.08105:
Nesterov SGD, lr 0.7, momentum 0.9). The local params then restart from the new global ones.

Plain averaging (FedAvg) is ``outer.optimizer=sgd outer.lr=1 outer.momentum=0``; Adam and any
other optimizer need no new code here, only a line in ``build_outer_optimizer``. SparseLoCo
(``outer.optimizer=sparseloco``) takes its momentum from the error feedback of its top-k codec
(compression/error_feedback.py; the rule's defaults: config/rules.py); with
``outer.sparseloco_momentum`` above 0 (the rule's default: 0.5) the step is Nesterov's over the
averaged sparse update, with 0 a plain step.

Where the global copy lives (``outer.global_device``): in host memory (``cpu``, the default:
pinned when the model is on a GPU, so copies to and from it are queued without blocking; see
host_copies.py), or beside the model (``model``: the pseudo-gradient and the outer step run on the
GPU; only the pseudo-gradient and its average cross to the host, for the transport).

``outer.sync_every=0`` is the data-parallel baseline instead: ``GradientAveraging`` averages the
gradients of every inner step over the same transport, counted the same way.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch

from diloco.comm.base import Averaging, Outcome, Staged, SyncResult, fingerprint_of
from diloco.compression import ErrorFeedback
from diloco.core.digest import state_digest, tensors_digest
from diloco.core.host_copies import GLOBAL_DEVICES, CopyFence, global_copy, on_cuda, state_to_cpu, to_device, to_host
from diloco.errors import require

T = TypeVar("T")

logger = logging.getLogger(__name__)

OUTER_OPTIMIZERS = ("nesterov", "sgd", "adam", "sparseloco")


@dataclass
class OuterConfig:
    optimizer: str = "nesterov"  # nesterov | sgd | adam | sparseloco (sgd with lr 1, momentum 0 is plain averaging)
    lr: float = 0.7  # outer learning rate
    momentum: float = 0.9  # SGD momentum, or Adam's beta1 (not sparseloco's: its error feedback is the momentum)
    sparseloco_momentum: float = 0.0  # sparseloco: Nesterov momentum over its averaged update (its rule: 0.5)
    sync_every: int = 50  # H: inner steps per round; 0 = data-parallel baseline (gradients averaged every step)
    round_s: float = 0.0  # > 0: a round lasts this many seconds of inner steps, as many as each worker can run; 0 = H
    overlap: str = "none"  # none: blocking round / delayed: applied one round late / streaming: fragments (overlap.py)
    fragments: int = 1  # streaming: P fragments of the params, each synced every H steps, staggered by H/P
    delay_steps: int = 1  # streaming: tau, inner steps between a fragment's sync and applying its average
    mix: float = 0.0  # streaming: alpha; a fragment's local params = alpha x local + (1 - alpha) x new global
    eager: bool = False  # delayed: each worker's fresh pseudo-gradient stands in for its stale share
    global_device: str = "cpu"  # global params and outer optimizer state: cpu (pinned for a CUDA model) / model


def validate_outer_config(cfg: OuterConfig) -> None:
    """Raise ``ConfigError`` naming the ``outer.*`` setting to change (the overlapped rounds' own:
    ``validate_overlap_config`` in overlap.py)."""
    require(
        cfg.optimizer in OUTER_OPTIMIZERS,
        f"outer.optimizer={cfg.optimizer!r} is not one of {', '.join(OUTER_OPTIMIZERS)}",
    )
    require(cfg.lr > 0, f"outer.lr={cfg.lr} must be positive")
    require(0 <= cfg.momentum < 1, f"outer.momentum={cfg.momentum} must be in [0, 1)")
    require(0 <= cfg.sparseloco_momentum < 1, f"outer.sparseloco_momentum={cfg.sparseloco_momentum} must be in [0, 1)")
    require(
        cfg.sync_every >= 0,
        f"outer.sync_every={cfg.sync_every} must be >= 0 (inner steps per round; 0 = data-parallel)",
    )
    require(
        cfg.global_device in GLOBAL_DEVICES,
        f"outer.global_device={cfg.global_device!r} is not one of {', '.join(GLOBAL_DEVICES)}",
    )


def build_outer_optimizer(cfg: OuterConfig, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """The outer optimizer over the global copy of the parameters."""
    if cfg.optimizer == "nesterov":  # with momentum 0, Nesterov's look-ahead is plain SGD
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.momentum, 0.999))
    if cfg.optimizer == "sparseloco":  # its decayed error feedback is its momentum, Nesterov's on top if asked
        momentum = cfg.sparseloco_momentum
        return torch.optim.SGD(params, lr=cfg.lr, momentum=momentum, nesterov=momentum > 0)
    raise ValueError(f"outer.optimizer={cfg.optimizer!r} is not one of {', '.join(OUTER_OPTIMIZERS)}")


class OuterStep:
    """Holds the global params (fp32; on the CPU or the model's device) and the outer optimizer over them.

    ``local_params`` are the model's parameters, trained by the inner optimizer; they are
    overwritten with the global params after every round. With a lossy codec on the wire,
    ``error_feedback`` adds what the last rounds did not send to the pseudo-gradient.
    """

    def __init__(
        self,
        local_params: Sequence[torch.nn.Parameter],
        cfg: OuterConfig,
        *,
        error_feedback: ErrorFeedback | None = None,
    ):
        self.local_params = list(local_params)
        self.error_feedback = error_feedback
        validate_outer_config(cfg)
        self.global_params = global_copy(self.local_params, cfg.global_device)
        # the optimizer's state sits beside the global params and never crosses the bus: not pinned
        self.optimizer = build_outer_optimizer(cfg, self.global_params)
        self._copy_back = CopyFence()  # the queued copies of the global params into the model
        # held while the global state changes, and while a peer's download reads it (offered_state)
        self._state_lock = threading.Lock()
        self._state_version = 0  # how many times the global state changed: an offer is of one version

    @torch.no_grad()
    def pseudo_gradients(self, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Global params at the start of the round minus local params now (fp32 CPU tensors, for the
        transport): written into ``out`` (the transport's own buffers: no other copy of the params is
        made, one tensor at a time), or fresh tensors."""
        if out is not None:
            for buffer, g, p in zip(out, self.global_params, self.local_params, strict=True):
                if g.device == buffer.device:
                    buffer.copy_(p.detach())  # from a GPU: one tensor's copy at a time
                    torch.sub(g, buffer, out=buffer)
                else:  # global params beside the model: the difference there, one tensor at a time
                    buffer.copy_(g - p.detach())
            return list(out)
        if not on_cuda(self.local_params):
            return [g - p.detach().to("cpu", torch.float32) for g, p in zip(self.global_params, self.local_params)]
        if on_cuda(self.global_params):  # subtract on the GPU, then one copy of the difference
            return to_host([g - p.detach() for g, p in zip(self.global_params, self.local_params)])
        staged = to_host(self.local_params)
        return [torch.sub(g, s, out=s) for g, s in zip(self.global_params, staged)]

    @torch.no_grad()
    def apply(self, averaged: Sequence[torch.Tensor]) -> None:
        """Outer optimizer step with ``averaged`` as the gradient; local params restart from the result.

        The copies into the model are queued, not awaited: the next inner step runs after them on
        the same stream, and the next write to the global params waits for them (``CopyFence``)."""
        self._copy_back.wait()
        with self.changing():
            for param, grad in zip(self.global_params, to_device(averaged, self.global_params)):
                param.grad = grad
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        for local, param in zip(self.local_params, self.global_params):
            local.copy_(param, non_blocking=True)
        self._copy_back.mark(self.local_params[0].device)

    @contextlib.contextmanager
    def changing(self):
        """Around every change of the global params or the outer optimizer's state: a peer's
        download never reads half of one, and what was offered before it is withdrawn."""
        with self._state_lock:
            self._state_version += 1
            yield

    def sync(self, averaging: Averaging, *, weight: float, round_index: int, deadline_s: float) -> SyncResult:
        """One round: pseudo-gradient, average with the other workers, outer step. When the average
        failed the worker applies its own pseudo-gradient; a round nobody could reduce
        (``Outcome.POSTPONED``) takes no outer step. The caller then runs the recovery protocol
        (recovery.py): after a round that failed, was partial or ran in a smaller group, it takes
        the state of a peer that did better (worker/sync_modes.py)."""
        result, pseudo_gradients, raw = self._average(averaging, weight, round_index=round_index, deadline_s=deadline_s)
        if result.outcome is Outcome.POSTPONED:
            # nobody could reduce (every live worker a client): no outer step, alone or otherwise, so
            # that every worker keeps the same global params; the local params train on and the next
            # round's pseudo-gradient holds this round's steps too (the residual waits for it as it was)
            logger.warning("round %d: %s", round_index + 1, result.error)
            if self.error_feedback is not None:
                self.error_feedback.take_back(pseudo_gradients, raw)
            return result
        self.account(result, f"round {round_index + 1}")
        self.apply(pseudo_gradients)
        return result

    def _average(
        self, averaging: Averaging, weight: float, *, round_index: int, deadline_s: float
    ) -> tuple[SyncResult, list[torch.Tensor], list[torch.Tensor]]:
        """The round's pseudo-gradient averaged: (result, the average (or ours when it failed), what
        the codec's residual made of ours (the pseudo-gradient itself without one)). Without error
        feedback it is formed in the transport's own buffers where it has them (``staging``), and
        formed again when an attempt left them changed: the local params do not change before the
        outer step, so it is the same."""
        if self.error_feedback is None or not self.error_feedback.enabled:  # sent as it is
            buffers, pseudo_gradients = self._staged(averaging)
            result = averaging.all_reduce_mean(pseudo_gradients, weight, round_index=round_index, deadline_s=deadline_s)
            if buffers is not None and not (result.averaged or result.outcome is Outcome.POSTPONED):  # undefined values
                pseudo_gradients = self.pseudo_gradients()
            return result, pseudo_gradients, pseudo_gradients
        raw = self.pseudo_gradients()
        pseudo_gradients = self.error_feedback.apply(raw)
        result = averaging.all_reduce_mean(pseudo_gradients, weight, round_index=round_index, deadline_s=deadline_s)
        return result, pseudo_gradients, raw

    def _staged(self, averaging: Averaging) -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
        """(the transport's buffers or None, the pseudo-gradient): formed in the buffers where the
        transport has them, one per param, and can hand them over now (an abandoned all-reduce may
        hold them past ``staging``'s bound: then in fresh tensors)."""
        try:
            with averaging.staging() as buffers:
                if buffers is not None and _shaped_like(buffers, self.global_params):
                    buffers = list(buffers)
                    formed = self.pseudo_gradients(out=buffers)
                    return buffers, Staged(formed, partial(self.pseudo_gradients, out=buffers))
        except TimeoutError:
            logger.warning("the averager still holds its buffers: this round's pseudo-gradient is formed apart")
        return None, self.pseudo_gradients()

    def account(self, result: SyncResult, where: str, indices: Sequence[int] | None = None) -> None:
        """What an average's ``result`` leaves the error feedback of the params ``indices`` (all:
        None) with, before the outer step applies it; a failed or partial one logged as ``where``."""
        # partial: the group's common mean, honest about how few it covers in places; sides: the
        # whole group's mean, in a group whose params differ (a split run met again)
        if result.outcome in (Outcome.PARTIAL, Outcome.SPLIT):
            logger.warning("%s: %s", where, result.error)
        elif not result.ok:  # the transport left our own pseudo-gradient in place: it is applied in full
            logger.warning("%s: averaging failed (%s)", where, result.error)
            if self.error_feedback is not None:
                self.error_feedback.forget(indices)  # what it had carried over is applied now, in full
        if result.averaged and self.error_feedback is not None:
            self.error_feedback.settle(result.codec, indices)  # a codec agreed per round: what it did not send

    def fingerprint(self) -> float:
        """A number in [0, 1) from the hash of the global params: equal exactly when they are."""
        return fingerprint_of(bytes.fromhex(tensors_digest(self.global_params)))

    def declared_digest(self, params_digest: str) -> str:
        """The digest a worker declares after a round (worker/round_end.py): of its global params
        (``params_digest``, their ``tensors_digest``) and its outer optimizer's state."""
        return state_digest(params_digest, self.optimizer.state_dict())

    @staticmethod
    def declared_digest_of(state: dict) -> str:
        """``declared_digest`` of a downloaded ``state`` (``state_dict``'s): its global params and
        its outer optimizer's state; "" for a state that holds no params."""
        params = state.get("global_params") if isinstance(state, dict) else None
        if not (isinstance(params, list) and params):
            return ""
        return state_digest(tensors_digest(params), state.get("optimizer", {}))

    def state_dict(self, *, copy: bool = True) -> dict:
        """A snapshot (tensors copied: the next outer step does not change it), on the CPU whatever
        ``outer.global_device`` is: checkpoints and peers' downloads load anywhere. With ``copy``
        false, on the CPU, the live tensors: for a caller that copies them itself (``CheckpointWriter``)
        or reads them at once."""
        return {
            "global_params": [p.detach().to("cpu", copy=copy) for p in self.global_params],
            "optimizer": state_to_cpu(self.optimizer.state_dict(), copy=copy),
        }

    @torch.no_grad()
    def model_state(self, model: torch.nn.Module) -> dict:
        """``model``'s state dict, each param that equals its global copy replaced by that copy (on
        the CPU): at a round's end the model's params are the global params, and a checkpoint then
        holds those bytes once. (A model on a GPU is compared there, one tensor at a time.) Its
        buffers, which a forward pass may change before the next update, are copies."""
        state = model.state_dict()
        named = dict(model.named_parameters(remove_duplicate=False))
        for name in state.keys() - named.keys():  # buffers a forward pass may change (running stats): copied
            if isinstance(state[name], torch.Tensor):
                state[name] = state[name].detach().to("cpu", copy=True)
        index = {id(param): i for i, param in enumerate(self.local_params)}
        for name, param in named.items():
            i = index.get(id(param))
            if i is None or name not in state or type(param.detach()) is not torch.Tensor:
                continue  # not averaged, a wrapped model's other names, or a shard
            copy = self.global_params[i].detach().to("cpu", copy=False)
            alike = copy.dtype == param.dtype and copy.shape == param.shape
            if alike and torch.equal(copy.to(param.device), param.detach()):
                state[name] = copy
        return state

    def offered_state(self) -> Callable[[Callable[[dict], T]], T | None]:
        """The global state as it is now, for a peer that may ask for it later: ``read(use)`` calls
        ``use`` with the live state (nothing copied on the CPU) under the lock that outer steps
        take, or returns None once an outer step has changed it since (the offer is then stale)."""
        version = self._state_version

        def read(use: Callable[[dict], T]) -> T | None:
            with self._state_lock:
                return use(self.state_dict(copy=False)) if self._state_version == version else None

        return read

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self._copy_back.wait()
        with self.changing():
            for param, saved in zip(self.global_params, state["global_params"], strict=True):
                param.copy_(saved)
            self.optimizer.load_state_dict(state["optimizer"])
        for local, param in zip(self.local_params, self.global_params):
            local.copy_(param)


class GradientAveraging:
    """The data-parallel baseline: called between backward and the inner optimizer's update, it
    replaces every gradient by its mean over the workers. Each call is a round on the transport;
    ``take_rounds`` hands back what the rounds since the last call cost."""

    def __init__(self, params: Sequence[torch.nn.Parameter], averaging: Averaging, *, weight: float, deadline_s: float):
        self.params, self.averaging = list(params), averaging
        self.weight, self.deadline_s = weight, deadline_s
        self.rounds_done = 0
        self._pending: list[tuple[SyncResult, float]] = []

    @torch.no_grad()
    def __call__(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        started = time.perf_counter()
        result = self.averaging.all_reduce_mean(
            grads, self.weight, round_index=self.rounds_done, deadline_s=self.deadline_s
        )
        measured = time.perf_counter() - started
        for param, grad in zip(self.params, grads):
            param.grad = grad
        self.rounds_done += 1
        self._pending.append((result, measured))

    def take_rounds(self) -> list[tuple[SyncResult, float]]:
        """(result, measured seconds) of each round since the last call."""
        pending, self._pending = self._pending, []
        return pending


def _shaped_like(buffers: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> bool:
    """Whether ``buffers`` are one fp32 CPU tensor per param, in its shape."""
    return len(buffers) == len(params) and all(
        b.shape == p.shape and b.dtype == torch.float32 and b.device.type == "cpu" for b, p in zip(buffers, params)
    )
