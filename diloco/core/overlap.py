"""Outer steps that hide communication behind the next inner steps (``outer.overlap``).

The blocking round (``overlap=none``, ``OuterStep.sync`` in outer.py) leaves the worker idle while
its pseudo-gradient travels. Here the average runs in the background instead
(``Averaging.start_all_reduce``) and is applied some inner steps later:

- ``streaming`` (Streaming DiLoCo, arXiv:2501.18512): the parameters are split into
  ``outer.fragments`` P fragments; fragment p syncs every H steps, at steps (p+1) H/P mod H, so
  only 1/P of the model is on the wire at a time. Its average is applied ``outer.delay_steps``
  tau inner steps later: the outer optimizer steps that fragment's global params, and its local
  params become ``mix`` x local + (1 - ``mix``) x global (alpha in the paper).
- ``delayed`` (one-step delay, as in DiLoCoX arXiv:2506.21263): the whole round's average runs
  during the next round and is applied at its end, one round late. The local params are never
  thrown back: after applying an average they restart from the new global params plus this
  worker's own progress of the round that just ended (its fresh pseudo-gradient stands in for
  the average still in flight), so no compute is lost and every round's progress reaches the
  global params exactly once; the global params stay identical on every worker.
  ``outer.eager=true`` is instead the eager update of arXiv:2502.12996: the outer gradient is the
  stale mean + (w/W) (own fresh - own stale) and the local params restart from the result;
  eager workers' global params then differ slightly, by design (each uses its own fresh share).

Both are the same machine: at each inner step, (1) the pseudo-gradients of the fragments due now
are taken (against the global params they started from), (2) averages started earlier whose
delay is up are waited for and applied, (3) the new ones start, (4) any with no delay are
applied. ``delayed`` is one fragment with a delay of H; one fragment with no delay is the
blocking round. The last inner step syncs every fragment and waits for everything, so a run
ends with every worker on the same params (eager excepted).

When an average fails for this worker (hivemind can lose part of a round for one sender), it
applies its own pseudo-gradient and its global params drift from the others'. What it does then
is the recovery protocol's (core/recovery.py): with one fragment it takes a peer's state right
away, as the blocking round does (``Recovery.after_average``); with several, a peer's state mixes
fragments at other points of their schedules, so the worker keeps going and takes a peer's whole
state at the run's end (``Recovery.at_run_end``), where every worker has applied the same
averages: a run still ends on identical params.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from diloco.comm.base import Averaging, Outcome, PendingAverage, SyncResult
from diloco.comm.bounds import round_limit_s
from diloco.core.outer import OuterConfig, OuterStep
from diloco.core.recovery import Recovery, RoundOutcome
from diloco.errors import require

logger = logging.getLogger(__name__)

OVERLAPS = ("none", "delayed", "streaming")


def split_fragments(params: list[torch.Tensor], count: int) -> list[list[int]]:
    """``count`` contiguous groups of parameter indices with about equal numbers of values."""
    total = sum(p.numel() for p in params)
    fragments: list[list[int]] = [[] for _ in range(count)]
    seen = 0
    for index, param in enumerate(params):
        # a tensor goes to the fragment its middle value falls in
        fragment = min(count - 1, int((seen + param.numel() / 2) * count / total))
        fragments[fragment].append(index)
        seen += param.numel()
    if any(not f for f in fragments):
        raise ValueError(f"outer.fragments={count}: the model has too few parameter tensors to split that finely")
    return fragments


def validate_overlap_config(outer: OuterConfig) -> None:
    """Raise ``ConfigError`` naming the ``outer.*`` setting of the overlapped rounds to change."""
    require(outer.overlap in OVERLAPS, f"outer.overlap={outer.overlap!r} is not one of {', '.join(OVERLAPS)}")
    require(outer.round_s >= 0, f"outer.round_s={outer.round_s} must be >= 0 (0 = outer.sync_every steps a round)")
    if outer.round_s > 0:
        require(outer.sync_every > 0, "outer.round_s needs DiLoCo rounds (outer.sync_every > 0)")
        require(outer.overlap == "none", "outer.round_s works with blocking rounds only (outer.overlap=none)")
    if outer.overlap != "none":
        require(outer.sync_every > 0, f"outer.overlap={outer.overlap} needs DiLoCo rounds (outer.sync_every > 0)")
    require(0 <= outer.mix < 1, f"outer.mix={outer.mix} must be in [0, 1)")
    require(outer.mix == 0 or outer.overlap == "streaming", "outer.mix applies to outer.overlap=streaming only")
    require(not outer.eager or outer.overlap == "delayed", "outer.eager=true applies to outer.overlap=delayed only")
    if outer.overlap == "streaming":
        require(outer.fragments >= 1, f"outer.fragments={outer.fragments} must be at least 1")
        require(
            outer.sync_every % outer.fragments == 0,
            f"outer.sync_every={outer.sync_every} must be a multiple of outer.fragments={outer.fragments} "
            "(fragments sync H/P steps apart)",
        )
        gap = min(outer.sync_every // outer.fragments, outer.sync_every - 1)
        require(
            0 <= outer.delay_steps <= gap,
            f"outer.delay_steps={outer.delay_steps} must be in [0, {gap}]: at most outer.sync_every / "
            "outer.fragments, and below outer.sync_every (a whole round late is outer.overlap=delayed)",
        )


def fragments_for(cfg: OuterConfig, params: list[torch.Tensor]) -> list[list[int]]:
    """The fragments ``cfg`` syncs separately: P of them for streaming, else one of everything."""
    if cfg.overlap == "streaming":
        return split_fragments(params, cfg.fragments)
    return [list(range(len(params)))]


@dataclass
class _InFlight:
    fragment: int
    averaged: list[torch.Tensor]  # holds what we sent for the fragment, then the mean
    own: list[torch.Tensor]  # our own pseudo-gradients (before error feedback)
    weight: float
    pending: PendingAverage
    apply_at: int  # inner step at which the mean is applied
    round_index: int  # the fragment's sync number
    compute_s_at_start: float  # the worker's compute time when it started (to model the simulator's overlap)


@dataclass
class Applied:
    """One average applied: its result and how long the worker waited for it."""

    result: SyncResult
    wait_s: float  # measured; for a simulated transport, the modelled time not hidden by compute
    recovered: bool = False  # the worker then took a peer's state (core/recovery.py)


class OverlappedOuter:
    """The outer steps of ``overlap=streaming`` or ``delayed`` over ``outer``'s global params and
    optimizer; ``after_inner_step`` is called after every inner step."""

    def __init__(
        self,
        outer: OuterStep,
        averaging: Averaging,
        recovery: Recovery,
        cfg: OuterConfig,
        *,
        deadline_s: float,
        expected_peers: int,
    ):
        self.outer, self.averaging, self.deadline_s = outer, averaging, deadline_s
        self.recovery = recovery  # after an applied average (``_recover``); recovers ``outer``'s state
        self.wait_limit_s = round_limit_s(deadline_s)  # an average not done by then is abandoned (comm/bounds.py)
        self.expected_peers = expected_peers
        self.every = cfg.sync_every
        self.mix = cfg.mix
        self.eager = cfg.overlap == "delayed" and cfg.eager
        self.fragments = fragments_for(cfg, outer.global_params)
        self.delay = cfg.sync_every if cfg.overlap == "delayed" else cfg.delay_steps
        count = len(self.fragments)
        self.offsets = [(p + 1) * self.every // count % self.every for p in range(count)]
        self.syncs_started = [0] * count
        self.last_start_step = [0] * count
        self.in_flight: list[_InFlight] = []

    def after_inner_step(self, step: int, *, samples_per_step: int, compute_s: float, final: bool) -> list[Applied]:
        """Start the syncs due after inner step ``step`` and apply the averages due; at the ``final``
        step, sync every fragment and apply everything. Returns what was applied."""
        due = [p for p in range(len(self.fragments)) if final or step % self.every == self.offsets[p]]
        if final and len(self.fragments) > 1:
            self.recovery.offer_before_end(sum(self.syncs_started))
        taken = {p: self._pseudo_gradients(p) for p in due}  # before any average lands in the params
        fresh = {p: own for p, (own, _) in taken.items()}
        applied = self._apply_due(step, fresh, final=final, compute_s=compute_s)
        for p, (own, to_send) in taken.items():
            if self.eager and self.syncs_started[p] == 0:  # no stale mean yet: our own share alone
                self._step_fragment(p, [d / self.expected_peers for d in own])
            weight = float(samples_per_step * (step - self.last_start_step[p]))
            self.last_start_step[p] = step
            round_index = self.syncs_started[p]
            pending = self.averaging.start_all_reduce(
                to_send, weight, round_index=round_index, deadline_s=self.deadline_s, fragment=p
            )
            self.syncs_started[p] += 1
            apply_at = step if final else step + self.delay
            self.in_flight.append(_InFlight(p, to_send, own, weight, pending, apply_at, round_index, compute_s))
        applied += self._apply_due(step, {}, final=final, compute_s=compute_s)
        if final and len(self.fragments) > 1:
            applied = self._recover_at_the_end(applied)
        return applied

    @torch.no_grad()
    def _pseudo_gradients(self, fragment: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This fragment's own progress since its last sync, and what to send for it (with error feedback).

        Usually global minus local params. With ``delayed`` (not eager) the local params carry the
        progress of the round in flight on top of the global ones, so that is taken out."""
        indices, outer = self.fragments[fragment], self.outer
        own = [outer.global_params[i] - outer.local_params[i].detach().to("cpu", torch.float32) for i in indices]
        carried = self._carries_progress and next((f.own for f in self.in_flight if f.fragment == fragment), None)
        if carried:
            own = [d - c for d, c in zip(own, carried)]
        to_send = own if outer.error_feedback is None else outer.error_feedback.apply(own, indices)
        # the average overwrites what is sent: copy only what error feedback did not already make anew
        return own, [t.clone() if t is d else t for t, d in zip(to_send, own)]

    @property
    def _carries_progress(self) -> bool:
        return self.delay == self.every and not self.eager

    def _apply_due(
        self, step: int, fresh: dict[int, list[torch.Tensor]], *, final: bool, compute_s: float
    ) -> list[Applied]:
        applied = []
        for flight in [f for f in self.in_flight if final or f.apply_at <= step]:
            self.in_flight.remove(flight)
            started = time.perf_counter()
            result = _not_postponed(flight.pending.wait(timeout_s=self.wait_limit_s))
            wait_s = time.perf_counter() - started
            if flight.pending.abandoned:  # its thread may still write the mean into what we apply
                flight.averaged = [t.clone() for t in flight.averaged]
            if result.simulated_s is not None:  # the simulator finished it at once: model the overlap
                wait_s = max(0.0, result.simulated_s - (compute_s - flight.compute_s_at_start))
            self._apply(flight, result, fresh.get(flight.fragment))
            recovered = self._recover(flight, RoundOutcome.of(result, flight.round_index), fresh.get(flight.fragment))
            applied.append(Applied(result, wait_s, recovered))
        return applied

    def _recover(self, flight: _InFlight, outcome: RoundOutcome, fresh: list[torch.Tensor] | None) -> bool:
        """After an applied average: with one fragment, the blocking round's recovery, keeping our
        own progress carried over; with several, the average is only noted (the state is taken at
        the run's end: ``_recover_at_the_end``). Returns whether a peer's state was taken."""
        if len(self.fragments) > 1:
            self.recovery.note_average(outcome)
            return False
        # an overlapped average neither skips the download by its group's size nor reads a group that
        # formed without it as the others moving on apart (a blocking round does both)
        outcome = replace(outcome, group=0, grouped=False)
        taken = self.recovery.after_average(outcome, expected_peers=self.expected_peers, timeout_s=self.deadline_s)
        if taken is not None:
            self._restart_local(flight.fragment, fresh if self._carries_progress else None)
        return taken is not None

    def _recover_at_the_end(self, applied: list[Applied]) -> list[Applied]:
        """After a run's last averages (several fragments): ``Recovery.at_run_end``; the local params
        restart from a state taken. Returns ``applied``, marked recovered if a state was taken."""
        taken = self.recovery.at_run_end(
            [a.result for a in applied],  # never empty: every fragment syncs at the last step
            round_index=sum(self.syncs_started),
            expected_peers=self.expected_peers,
            timeout_s=self.deadline_s,
        )
        if taken is None:
            return applied
        for fragment in range(len(self.fragments)):
            self._restart_local(fragment)
        return [replace(a, recovered=True) for a in applied]

    def _apply(self, flight: _InFlight, result: SyncResult, fresh: list[torch.Tensor] | None) -> None:
        """Apply an average. ``fresh``: this worker's own progress since, taken at this very step (if any)."""
        self.outer.account(result, f"fragment {flight.fragment}", self.fragments[flight.fragment])
        if self._carries_progress and fresh is None:  # delayed's last round, applied at once at the end
            self._merge(flight.fragment, flight.averaged)
            return
        if not self.eager:
            self._step_fragment(flight.fragment, flight.averaged, carried=fresh if self._carries_progress else None)
            return
        gradient = self._eager(flight, result, fresh)
        if fresh is None and not any(bool(g.any()) for g in gradient):
            self._restart_local(flight.fragment)  # alone, nothing is left to apply: no extra momentum step
            return
        self._step_fragment(flight.fragment, gradient)

    @torch.no_grad()
    def _step_fragment(
        self, fragment: int, gradient: list[torch.Tensor], *, carried: list[torch.Tensor] | None = None
    ) -> None:
        """Outer step of one fragment's global params; its local params restart from them."""
        indices, outer = self.fragments[fragment], self.outer
        with outer.changing():
            for i, grad in zip(indices, gradient):
                outer.global_params[i].grad = grad
            outer.optimizer.step()  # parameters without a gradient (other fragments) are left alone
            outer.optimizer.zero_grad(set_to_none=True)
        self._restart_local(fragment, carried)

    @torch.no_grad()
    def _merge(self, fragment: int, mean: list[torch.Tensor]) -> None:
        """Global params minus the mean progress, no outer step: the weighted mean of the workers'
        local params. Ends a delayed run: right after the previous round's outer step, a second
        one adds its momentum twice (on the utilization workload the loss rose from 2.67 to 3.10)."""
        with self.outer.changing():
            for i, delta in zip(self.fragments[fragment], mean):
                self.outer.global_params[i].sub_(delta)
        self._restart_local(fragment)

    @torch.no_grad()
    def _restart_local(self, fragment: int, carried: list[torch.Tensor] | None = None) -> None:
        """The fragment's local params restart from its global ones: minus the own progress ``carried``
        over (delayed), or mixed with themselves by ``mix`` (streaming)."""
        outer = self.outer
        for k, i in enumerate(self.fragments[fragment]):
            local, param = outer.local_params[i], outer.global_params[i]
            if carried is not None:
                local.copy_(param - carried[k])
            else:
                local.copy_(param if self.mix == 0 else torch.lerp(param, local.detach().to(param), self.mix))

    def _eager(self, flight: _InFlight, result: SyncResult, fresh: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Stale mean + (w/W)(own fresh - own stale): our own share of the average, brought up to date.
        For the last step's own average (``fresh`` None) the share applied eagerly is taken back out,
        so that over the run each own pseudo-gradient counts once (the first one is applied alone).
        (w/W is the share of a mean over every worker; top-k's mean is taken value by value over the
        workers that sent the value, where our share is larger: with it the correction is the same
        approximation a lossy codec makes of the own stale contribution.)"""
        share = flight.weight / result.total_weight if result.averaged and result.total_weight > 0 else 1.0
        gradient = []
        for k, mean in enumerate(flight.averaged):
            own_now = fresh[k] if fresh is not None else torch.zeros_like(mean)
            gradient.append(mean + share * (own_now - flight.own[k]))
        return gradient

    def state_dict(self) -> dict:
        """Where the schedule stands (averages in flight are not saved: a resumed worker starts afresh)."""
        return {
            "syncs_started": list(self.syncs_started),
            "last_start_step": list(self.last_start_step),
            **self.recovery.state_dict(),  # whether an average failed for it since it last took a state
        }

    def load_state_dict(self, state: dict) -> None:
        self.syncs_started = list(state["syncs_started"])
        self.last_start_step = list(state["last_start_step"])
        self.recovery.load_state_dict(state)


def _not_postponed(result: SyncResult) -> SyncResult:
    """An overlapped average nobody could reduce is a failed one: the fragment takes its own step
    (an average in flight cannot wait for the next round's)."""
    return replace(result, outcome=Outcome.FAILED) if result.outcome is Outcome.POSTPONED else result
