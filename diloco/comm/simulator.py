"""M simulated workers inside one process, taking turns, with a model of their links.

``diloco local CONFIG --workers M comm.backend=simulator`` runs the very same ``train()`` loop for
every worker, each in its own thread; this backend is the only thing that differs. The workers
take turns from the very start (``simulate`` in tools/launcher.py makes each thread wait for its turn
before it even builds its model, so the shared global RNG gives every worker the same initial
params): exactly one computes at a time (so each one's measured compute time is its own, as
if it had the machine to itself), and a round's mean is taken in worker order, so a run is
deterministic for a seed. Pseudo-gradients are compressed and checked exactly as over the
network (``average_payloads`` in reduce.py): bytes are counted from the real payloads.

The link model turns the bytes of each round into the time the round would take on such links:
in hivemind's butterfly all-reduce each of n workers uploads (n-1)/n of the payload to the
reducers and then (n-1)/n back out as averaged parts, so a round costs

    2 (n-1)/n x payload_bytes x 8 / (bandwidth_mbps x 1e6 x GOODPUT)  +  2 x latency_ms / 1000   seconds.

GOODPUT is the share of a link's bits that is payload: TCP over IPv4 with timestamps in
1500-byte Ethernet frames carries 1448 payload bytes per 1514 on the wire. (The testbed, with
real peers on tbf-shaped links, checks this model's round time within 25%.)

(payload_bytes is what the codec makes of the tensors; for a codec that gathers, top-k, each
worker sends its payload to each of the others instead: (n-1) x payload_bytes.) That time is
reported as the round's communication time, and its bytes as bytes sent and received.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from diloco.comm.base import Averaging, CommBackend, Outcome, SyncResult
from diloco.comm.config import CommConfig
from diloco.comm.reduce import Contribution, Verdicts, average_payloads
from diloco.comm.robust import NO_SCREENING, ScreeningRules
from diloco.comm.scores import Scores
from diloco.comm.verdicts import SketchHistory
from diloco.comm.volume import sent_bytes
from diloco.compression import Codec

_GROUPS: dict[str, SimulatedGroup] = {}
_GROUPS_LOCK = threading.Lock()


GOODPUT = 1448 / 1514


def round_time_s(
    payload_bytes: int, num_workers: int, *, bandwidth_mbps: float, latency_ms: float, gathers: bool = False
) -> float:
    """Seconds for one butterfly all-reduce of ``payload_bytes`` among ``num_workers`` on links of
    ``bandwidth_mbps`` (each direction) and ``latency_ms`` (``gathers``: an all-gather of them
    instead); 0 for a single worker."""
    if num_workers <= 1:
        return 0.0
    volume_bytes = sent_bytes(payload_bytes, num_workers, gathers=gathers)
    transfer_s = volume_bytes * 8 / (bandwidth_mbps * 1e6 * GOODPUT) if bandwidth_mbps > 0 else 0.0
    return transfer_s + 2 * latency_ms / 1000


class SimulatedGroup:
    """The rendezvous of M worker threads: whose turn it is, and the round being averaged."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._cond = threading.Condition()
        self._turn = 0  # the worker allowed to compute now
        self._finished: set[int] = set()
        self._arrived: dict[int, Contribution] = {}
        self._round_done = 0  # rounds averaged so far
        self._last: tuple[list[torch.Tensor], list[Contribution]] = ([], [])  # (means, contributions used)
        self._reducer: tuple[Codec, list[int], ScreeningRules] | None = None  # (codec, numel of each tensor, rules)
        self.scores: Scores | None = None  # each worker's standing across rounds (made with the first rules)
        self._index: dict[str, int] = {}  # a contribution's sender (as the log names it) -> its worker index
        self.history = SketchHistory()  # the sketches of earlier rounds: a replay is left out (verdicts.py)

    def wait_turn(self, worker: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == worker)

    def _pass_turn(self, worker: int) -> None:
        """Hand the turn to the next worker that has not finished (called with the lock held)."""
        for offset in range(1, self.num_workers + 1):
            candidate = (worker + offset) % self.num_workers
            if candidate not in self._finished:
                self._turn = candidate
                break
        self._cond.notify_all()

    def all_reduce(
        self,
        worker: int,
        contribution: Contribution,
        codec: Codec,
        numels: list[int],
        *,
        rules: ScreeningRules = NO_SCREENING,
    ) -> tuple[list[torch.Tensor], list[Contribution]]:
        """Block until every live worker has arrived; return the averaged flat tensors and the
        contributions in them (see ``average_payloads``, which screens them as ``rules`` say)."""
        with self._cond:
            if not self._arrived:  # the first to arrive sets the round's shapes (fragments differ)
                self._reducer = (codec, numels, rules)
            self._arrived[worker] = contribution
            round_index = self._round_done
            if not self._complete_round_if_all_arrived():
                self._pass_turn(worker)
            self._cond.wait_for(lambda: self._round_done > round_index and self._turn == worker)
            return self._last

    def _complete_round_if_all_arrived(self) -> bool:
        """Average once every live worker has arrived (called with the lock held)."""
        live = self.num_workers - len(self._finished)
        if not self._arrived or len(self._arrived) < live:
            return False
        self._last = self._average()
        self._round_done += 1
        self._turn = min(self._arrived)  # the next round starts with the first worker again
        self._arrived = {}
        self._cond.notify_all()
        return True

    def _average(self) -> tuple[list[torch.Tensor], list[Contribution]]:
        """The round's mean of the contributions of the workers not excluded, in worker order (the
        same sum on every run); the round's verdicts counted in ``scores``."""
        codec, numels, rules = self._reducer
        self.scores = self.scores or Scores(rules.exclude_after, rules.readmit_after)
        arrived = [c for _, c in sorted(self._arrived.items())]
        taken = [c for c in arrived if not self.scores.is_excluded(c.worker)]
        self._index.update({c.worker: w for w, c in self._arrived.items()})
        verdicts = Verdicts()
        averaged = average_payloads(
            codec, taken, numels, round_index=self._round_done, rules=rules, verdicts=verdicts, history=self.history
        )
        context = f"round {self._round_done + 1}: "
        self.scores.record_round([c.worker for c in arrived], verdicts.left_out, verdicts.clipped, context=context)
        return averaged

    def excluded(self) -> tuple[int, ...]:
        """The workers excluded from the means so far."""
        with self._cond:
            return tuple(sorted(self._index[who] for who in self.scores.excluded())) if self.scores else ()

    def finish(self, worker: int) -> None:
        """A worker is done (or failed): nobody waits for it any more. Safe to call twice."""
        with self._cond:
            if worker in self._finished:
                return
            self._finished.add(worker)
            self._arrived.pop(worker, None)
            still_running = len(self._finished) < self.num_workers
            if still_running and not self._complete_round_if_all_arrived() and self._turn == worker:
                self._pass_turn(worker)


def group_for(run_id: str, num_workers: int) -> SimulatedGroup:
    """The process-wide group of ``run_id`` (created by the first worker that asks)."""
    with _GROUPS_LOCK:
        group = _GROUPS.get(run_id)
        if group is None or group.num_workers != num_workers:
            group = _GROUPS[run_id] = SimulatedGroup(num_workers)
        return group


def forget_group(run_id: str) -> None:
    with _GROUPS_LOCK:
        _GROUPS.pop(run_id, None)


class SimulatedAveraging(Averaging):
    """One simulated worker's averaging in its ``SimulatedGroup``."""

    simulated = True

    def __init__(self, cfg: CommConfig, group: SimulatedGroup, *, worker_index: int, codec: Codec):
        self.group, self.worker_index, self.codec = group, worker_index, codec
        self.bandwidth_mbps, self.latency_ms = cfg.bandwidth_mbps, cfg.latency_ms
        self.rules = ScreeningRules.of(cfg)

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        payloads = [self.codec.compress(t) for t in tensors]
        numels = [t.numel() for t in tensors]
        mine = Contribution(f"worker {self.worker_index}", payloads, weight)
        means, used = self.group.all_reduce(
            self.worker_index,
            mine,
            self.codec,
            numels,
            rules=self.rules,
        )
        peers, total = len(used), sum(c.weight for c in used)
        if not used:
            return SyncResult(Outcome.FAILED, 1, weight, error="every contribution was dropped")
        for tensor, mean in zip(tensors, means):
            tensor.copy_(mean.view_as(tensor))
        payload, gathers = sum(len(p) for p in payloads), self.codec.gathers
        volume = sent_bytes(payload, peers, gathers=gathers)
        seconds = round_time_s(
            payload, peers, bandwidth_mbps=self.bandwidth_mbps, latency_ms=self.latency_ms, gathers=gathers
        )
        return SyncResult(
            Outcome.AVERAGED,
            peers,
            total,
            bytes_sent=volume,
            bytes_recv=volume,
            simulated_s=seconds,
            excluded=self.group.excluded(),
        )


class SimulatedBackend(CommBackend):
    """One simulated worker's transport: it only averages. Constructing it waits for the worker's
    turn; shutting it down ends the worker's part in the group."""

    def __init__(self, cfg: CommConfig, *, num_workers: int, worker_index: int, codec: Codec):
        self.group, self.worker_index = group_for(cfg.run_id, num_workers), worker_index
        self._closed = False
        self.group.wait_turn(worker_index)
        super().__init__(SimulatedAveraging(cfg, self.group, worker_index=worker_index, codec=codec))

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.group.finish(self.worker_index)
