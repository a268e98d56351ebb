"""One attempt at a round in a group: matchmaking under the round's key, the all-reduce, and what
the group's result means for this worker.

The attempt declares the worker's weight, the norm of what it sends and (``compression.name=
adaptive``) the codec it prefers; hivemind finds the group and every peer gathers the others'
declarations. Every peer screens the group's contributions alike from the declared norms
(``robust.py``) and agrees on the codec alike; then hivemind's averager reduces the vector, or the
gloo data plane does (``gloo_plane.py``: fp32 rounds among peers that can all be dialled). A
result is ok only when every part of the vector is the mean over the same contributions.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from diloco.comm import sketch
from diloco.comm.base import Outcome, SyncResult
from diloco.comm.config import CommConfig
from diloco.comm.hivemind import gloo_plane
from diloco.comm.hivemind.helper_record import contributors
from diloco.comm.link_meter import CodecChoice
from diloco.comm.robust import (
    Screening,
    ScreeningRules,
    declared_norm,
    declared_sketches,
    declared_weights,
    norm_of,
    screen,
)
from diloco.compression import all_finite

logger = logging.getLogger(__name__)

_ROUND_BITS = 16  # rounds are keyed modulo 2**16 on the DHT: far more than any peer can lag
_POLL_S = 1.0  # how often a worker waiting for a group checks whether the others went ahead
# why a worker stopped looking for a group: one that counted it in too late broke without it
LEFT_BEHIND = "a group of this round counted us in after we had given up on it, and broke without us"


def await_result(control, *, limit: float, pointless: Callable[[], str], stage: Callable[[str], None] = lambda _: None):
    """The result of hivemind's step ``control``, polled every ``_POLL_S`` (each poll tells ``stage``
    whether it is matchmaking or averaging). It is cancelled with ``TimeoutError`` at ``limit``
    (monotonic time), or, while still matchmaking, once ``pointless()`` says why waiting is."""
    started = time.monotonic()
    while True:
        stage("averaging" if control.began_allreduce else "matchmaking")
        try:
            return control.result(timeout=max(0.0, min(_POLL_S, limit - time.monotonic())))
        except concurrent.futures.TimeoutError:
            pass
        if time.monotonic() >= limit:
            where = "the all-reduce" if control.began_allreduce else "matchmaking"
            control.cancel()
            raise TimeoutError(f"no result from the averager after {time.monotonic() - started:.0f} s in {where}")
        if not control.began_allreduce and (why := pointless()):
            control.cancel()
            raise TimeoutError(why)


def left_behind_since(averager, count: int | None) -> bool:
    """Whether ``averager`` saw a group left behind since its count was ``count`` (None: never)."""
    return count is not None and averager.traffic.groups_left_behind() > count


def round_group_bits(round_index: int, attempt: int = 0) -> str:
    """The hivemind group bits that key a round's matchmaking on the DHT (a retry gets its own key)."""
    return format(round_index % (1 << _ROUND_BITS), f"0{_ROUND_BITS}b") + "1" * attempt


def model_sides(models: dict, own) -> tuple[int, ...]:
    """How many peers of a group declared each model (the digest of their params), ``own``'s model
    first, then the others from the most held; peers that declared none are left out (a worker that
    has not finished a round yet). One entry (or none): the group held one model."""
    counts = collections.Counter(model for model in models.values() if model)
    ours = models.get(own)
    if not ours:
        return ()
    return (counts.pop(ours),) + tuple(sorted(counts.values(), reverse=True))


def _declared_model(declared) -> str:
    """The params digest a peer declared (``""``: none, or not a string: a peer of another version)."""
    model = declared.get("model") if isinstance(declared, dict) else None
    return model if isinstance(model, str) else ""


@dataclasses.dataclass
class Attempt:
    """One try at round ``round_index`` (``attempt`` 1: the retry among survivors), in a group the
    roster expects to be ``expected`` workers and ``helpers`` helpers, given ``timeout_s`` by
    hivemind and stopped at ``limit`` (monotonic time) whatever hivemind does."""

    round_index: int
    attempt: int
    expected: int
    timeout_s: float
    limit: float
    helpers: int = 0
    # the averager's count of groups left behind when the round began: a first attempt stops once
    # it grows; None for a retry (where the left-behind meet again: a part of the broken group
    # refused late must not stop it)
    left_before: int | None = None
    fragment: int = dataclasses.field(kw_only=True)  # the fragment of the params it averages
    # a retry's: the members of the broken group lost inside its all-reduce (crashed, or cut off
    # from us), not waited for: the survivors start as soon as they are all there
    lost: int = dataclasses.field(default=0, kw_only=True)

    @property
    def group_size(self) -> int:
        """The group hivemind starts the all-reduce with as soon as it is complete."""
        return max(2, self.expected + self.helpers - self.lost)


class RoundRoster(Protocol):
    """The roster as a round sees it (``roster.Roster``): ``stage(name)`` tells what the round is
    doing; ``model`` is the digest of our params after our last round ("" before the first)."""

    @property
    def model(self) -> str: ...

    def stage(self, stage: str | None) -> None: ...


class RoundOffers(Protocol):
    """The peers' state offers as a round reads them (``state_offers.StateOffers``)."""

    def averaged_in_a_group(self, round_index: int) -> bool:
        """Whether a peer offers its state after round ``round_index``, averaged in a group."""
        ...


class Others(Protocol):
    """The run's other workers as a round still matchmaking asks about them (``others.OtherWorkers``)."""

    def others_gone(self) -> bool:
        """Whether no other worker is left in the run."""
        ...

    def others_done(self, fragment: int, round_index: int) -> bool:
        """Whether every other live worker is done with round ``round_index``'s average of ``fragment``."""
        ...


class GroupRound:
    """Runs attempts on one worker's averagers. ``own_id``: our peer's id; ``plane``: the gloo data
    plane or None; ``roster`` is told what the round is doing and declares our params' digest;
    ``offers`` (a peer's state averaged in a group this round) and ``others`` (gone, or done with
    this round) tell a worker still matchmaking that waiting is pointless."""

    def __init__(
        self,
        cfg: CommConfig,
        *,
        codecs: CodecChoice,
        own_id,
        plane,
        roster: RoundRoster,
        offers: RoundOffers,
        others: Others,
        control_s: float,
    ):
        self.cfg, self.codecs, self.codec = cfg, codecs, codecs.codec
        self._own_id, self._plane, self._roster = own_id, plane, roster
        self._offers, self._others = offers, others
        self._control_s = control_s
        self._rules = ScreeningRules.of(cfg)

    def run(
        self, averager, flat: torch.Tensor, tensors: Sequence[torch.Tensor], weight: float, at: Attempt
    ) -> SyncResult:
        """Average ``tensors`` in place with the group ``averager`` finds (``flat``: the averager's
        tensors as one buffer, for the data plane)."""
        sent_before, recv_before, failed_before, drops_before = averager.traffic.read()
        averager.traffic.take_contributions()  # what an earlier round left
        declared = self._declaration(tensors, weight, at)
        transfer_before = averager.traffic.transfer_s()
        try:
            gathered = self._step(averager, tensors, weight, declared, at)
        except Exception as error:  # hivemind raises a zoo of errors; a failed round is a result
            gathered, failure = None, f"{type(error).__name__}: {error}"
        else:
            failure = "" if gathered is not None else "no group found before the deadline"
            gathered = contributors(gathered or {})
        finally:
            self._roster.stage(None)
        sent, recv, failed, drops = averager.traffic.read()
        sent, recv, failed_values = sent - sent_before, recv - recv_before, failed - failed_before
        transfer_s = averager.traffic.transfer_s() - transfer_before
        if failure:
            # a transfer that did not finish says the link is too slow for the codec it used (the
            # averager's process says which; nothing is measured when no all-reduce began)
            self.codecs.measure(self.codec.candidates[averager.traffic.used_codec()], sent + recv, transfer_s)
            return SyncResult(Outcome.FAILED, 1, weight, sent, recv, error=failure)
        # the group's screening (robust.py), which every peer computes alike from what it gathered
        screening = self._screening(gathered, at)
        codec = self.codec.agreed(gathered.values())  # as every peer of the group does
        if gloo_plane.carries(codec, list(gathered.values())):  # hivemind found the group; gloo averages
            started = time.monotonic()
            result = self._over_plane(flat, tensors, gathered, screening)
            self.codecs.measure(codec, result.bytes_sent + result.bytes_recv, time.monotonic() - started)
            result = dataclasses.replace(result, codec=self.codecs.named(codec))
        else:
            self.codecs.measure(codec, sent + recv, transfer_s)
            if drops > drops_before:  # our own reducer could not read what we sent: neither could the others
                screening.dropped.setdefault(self._own_id, "our payload is unusable (see the averager's log)")
            traffic = (sent, recv, failed_values)
            result = self._result(averager, tensors, weight, gathered, screening, codec, traffic)
        sides = model_sides({peer: _declared_model(g) for peer, g in gathered.items()}, self._own_id)
        if len(sides) > 1 and result.averaged:
            text = " + ".join(map(str, sides))
            error = (
                f"the group held {len(sides)} models ({text} workers, ours first): a split run met again, or a "
                f"worker that missed a state; the side that ranks lower takes the other's"
            )
            # a whole mean of two models is the SPLIT outcome; a partial one stays partial, with its sides
            outcome = Outcome.SPLIT if result.outcome is Outcome.AVERAGED else result.outcome
            result = dataclasses.replace(result, outcome=outcome, sides=sides, error=result.error or error)
        return result

    def _declaration(self, tensors: Sequence[torch.Tensor], weight: float, at: Attempt) -> dict:
        """What we declare at matchmaking: our weight, the norm (and, when the run judges them, the
        sketch: verdicts.py) of what the reducers will decode, so that every peer screens whole
        vectors alike (robust.py; a codec agreed per round is not known yet: those of the tensors
        themselves then), the round, our codec preference and the digest of our params."""
        exact = self.codec.lossless or self.codec.chosen_per_round
        decoded = tensors if exact else [self.codec.restore(t) for t in tensors]
        declared = {"weight": weight, "norm": norm_of(decoded), "round": [at.round_index, at.fragment]}
        if self._rules.judges_sketches:
            declared["sketch"] = sketch.encode(sketch.sketch_of(decoded))
        preference = self.codecs.preference(tensors, peers=max(2, at.expected))
        if preference is not None:
            declared["codec"] = preference  # the group takes the most lossy preference (adaptive.py)
        if model := self._roster.model:
            declared["model"] = model  # the digest of our params: a group that holds two is a split met again
        return declared

    def _screening(self, gathered: dict, at: Attempt) -> Screening:
        """The group's screening (robust.py), which every peer computes alike from what it gathered
        (the replays our averager's reducer left out are its own: their parts' counts tell us)."""
        return screen(
            {peer: declared_norm(g) for peer, g in gathered.items()},
            self._rules,
            declared_weights(gathered),
            sketches=declared_sketches(gathered) if self._rules.judges_sketches else None,
            round_index=at.round_index,
            fragment=at.fragment,
        )

    def _step(self, averager, tensors: Sequence[torch.Tensor], weight: float, declared: dict, at: Attempt):
        """Load our contribution into the averager, declare ``declared`` (with the data plane's
        address) and wait for the group's step: what each peer of the group declared, or None when
        no group formed."""
        averager.set_group(
            round_group_bits(at.round_index, at.attempt),
            target_group_size=at.group_size,
            timeout_s=self._control_s,
        )
        with averager.tensors_within(self._control_s) as buffers:
            for buffer, tensor in zip(buffers, tensors):
                if not same_memory(buffer, tensor):  # the caller formed them in ours (``staging``): nothing to copy
                    buffer.copy_(tensor)
        plane = self._plane.declaration() if self._plane is not None else {}
        control = averager.step(weight=weight, gather={**declared, **plane}, timeout=at.timeout_s, wait=False)
        return self.await_step(
            control,
            at.round_index,
            limit=at.limit,
            left_behind=lambda: left_behind_since(averager, at.left_before),
            fragment=at.fragment,
        )

    def await_step(
        self,
        control,
        round_index: int,
        *,
        limit: float,
        fragment: int,
        left_behind: Callable[[], bool] = lambda: False,
    ):
        """The step's result. A worker still looking for a group when a peer already offers the
        round's state averaged in a group (the others went ahead without it: it came late) stops
        looking, instead of matchmaking alone until the deadline; the catch-up then takes that state.
        So does one ``left_behind()``: a leader counted it in a group after it had given up on that
        group (the leader's answer came late), it refused that group's parts, and the group broke:
        its peers retry among themselves, and so does this worker (``averaging.py``). So does one
        whose every live peer is done with this round's average of ``fragment`` (it came a whole
        average late: a fragment's averages offer no state to tell). At ``limit`` (monotonic time)
        it stops waiting whatever hivemind is doing."""

        def pointless() -> str:
            if self._offers.averaged_in_a_group(round_index):
                return "the others averaged this round without us"
            if left_behind():
                return LEFT_BEHIND
            if self._others.others_done(fragment, round_index):
                return "every other live worker is done with this round's average: it went on without us"
            return "no other worker of the run is live" if self._others.others_gone() else ""

        return await_result(control, limit=limit, pointless=pointless, stage=self._roster.stage)

    def _result(
        self, averager, tensors, weight: float, gathered: dict, screening: Screening, codec, traffic
    ) -> SyncResult:
        """What hivemind's all-reduce left in the averager's tensors means for us."""
        sent, recv, failed_values = traffic
        group = len(gathered)
        if self._own_id in screening.dropped:  # the others refused our contribution: no retry
            error = f"the group dropped our contribution: {screening.dropped[self._own_id]}"
            return SyncResult(Outcome.DROPPED, 0, weight, sent, recv, error=error, group=group)
        if failed_values:
            # some reducer dropped out: part of the buffers hold our own values, not the mean
            error = f"{failed_values} values were not averaged"
            return SyncResult(Outcome.FAILED, 1, weight, sent, recv, error=error, group=group)
        try:
            with averager.tensors_within(self._control_s) as buffers:
                for buffer, tensor in zip(buffers, tensors):
                    if not same_memory(buffer, tensor):
                        tensor.copy_(buffer)
        except TimeoutError as error:
            return SyncResult(Outcome.FAILED, 1, weight, sent, recv, error=str(error), group=group)
        kept = screening.scales  # the peers whose contribution is in the mean
        total_weight = sum(
            screening.weight(float(g.get("weight", 0.0))) for peer, g in gathered.items() if peer in kept
        )
        counted = averager.traffic.take_contributions()
        least, most = counted if counted is not None else (len(kept), len(kept))
        named = self.codecs.named(codec)
        if least < most:
            # a reducer averaged a part without some sender (it could not reach it, or it came late):
            # every worker holds the same mean, but that part is of fewer workers: not ok on any of them
            error = f"part of the vector was averaged over only {least} of {most} contributions"
            return SyncResult(Outcome.PARTIAL, least, total_weight, sent, recv, error=error, group=group, codec=named)
        # every part over the same contributions: fewer than kept when every reducer refused one it
        # could not decode (the sender then knows: its own reducer refused it too)
        return SyncResult(Outcome.AVERAGED, min(least, len(kept)), total_weight, sent, recv, group=group, codec=named)

    def _over_plane(self, flat: torch.Tensor, tensors, gathered: dict, screening: Screening) -> SyncResult:
        """The group's weighted mean through the data plane (gloo_plane.py): every peer scales its
        own vector by its weight and screening factor (0: dropped, it still takes part so that
        nobody waits for it), the ring all-reduce sums them, and every peer divides alike."""
        own = self._own_id
        weights = {peer: screening.weight(float(g.get("weight", 0.0))) for peer, g in gathered.items()}
        kept = screening.scales
        total_weight = sum(weights[peer] for peer in kept)
        moved = gloo_plane.ring_bytes(flat.numel(), len(gathered))
        factor = weights[own] * kept[own] if own in kept else 0.0
        self._roster.stage("averaging")
        try:
            if factor == 0.0:
                flat.zero_()  # not mul_: our dropped vector may hold NaN
            elif factor != 1.0:
                flat.mul_(factor)
            self._plane.all_reduce_sum(flat, gathered, own)
            if own not in kept:
                reason = screening.dropped.get(own, "dropped")
                error = f"the group dropped our contribution: {reason}"
                return SyncResult(Outcome.DROPPED, 0, weights[own], moved, moved, error=error, group=len(gathered))
            flat.div_(total_weight)
            if not all_finite(flat):
                raise ValueError("the mean is not finite")
        except Exception as error:  # a peer gone or cut off, a timeout: the group's round failed
            error = f"data plane: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            return SyncResult(Outcome.FAILED, 1, weights[own], moved, moved, error=error, group=len(gathered))
        finally:
            self._roster.stage(None)
        for mean, tensor in zip(flat.split([t.numel() for t in tensors]), tensors):
            if not same_memory(mean.view_as(tensor), tensor):
                tensor.copy_(mean.view_as(tensor))
        return SyncResult(Outcome.AVERAGED, len(kept), total_weight, moved, moved, group=len(gathered))


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same values in memory (a copy between them would change nothing)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
