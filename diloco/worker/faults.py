"""Fault injection at named points, for tests and the fault benchmarks (as torchft does).

    diloco train ... faults.skip_round=2        # sit out round 2's averaging, as if the link dropped
    diloco train ... faults.stop_after_round=3  # exit right after round 3's checkpoint, as if killed
    diloco local ... faults.worker=1 faults.skip_round=2   # only worker 1 of a local run
    diloco local ... faults.worker=1 faults.bad_payload=nan  # worker 1 sends NaN payloads
    diloco local ... faults.worker=1 faults.step_delay_s=0.2  # worker 1 computes like a slower machine
    diloco local ... faults.worker=1 faults.bad_payload=scaled  # worker 1 sends 100 x its pseudo-gradient

Faults wrap the real parts; nothing else in the code knows about them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from diloco.comm.base import CommBackend, PeerState, StateRank, StateReader, SyncResult
from diloco.compression import Codec
from diloco.config import FaultConfig


class StopRequested(Exception):
    """Raised by ``faults.stop_after_round`` to end the worker as if it had been killed."""


class DelegatingBackend(CommBackend):
    """Forwards everything to ``inner``; a fault overrides only what it breaks."""

    def __init__(self, inner: CommBackend):
        self.inner = inner
        self.simulated, self.averages_in_background = inner.simulated, inner.averages_in_background

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        return self.inner.all_reduce_mean(
            tensors, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
        )

    def publish_state(self, round_index: int, rank: StateRank, state: StateReader) -> None:
        self.inner.publish_state(round_index, rank, state)

    def fetch_state(
        self, round_index: int, *, better_than: StateRank, timeout_s: float, newer: bool = False
    ) -> PeerState | None:
        return self.inner.fetch_state(round_index, better_than=better_than, timeout_s=timeout_s, newer=newer)

    def sole_state_source(self) -> bool:
        return self.inner.sole_state_source()

    def expected_peers(self) -> int | None:
        return self.inner.expected_peers()

    def report_progress(self, round_index: int, step: int, stats: dict | None = None) -> None:
        self.inner.report_progress(round_index, step, stats)

    def report_phase(self, phase: str, since: float) -> None:
        self.inner.report_phase(phase, since)

    def announce_run(self, identity: dict) -> None:
        self.inner.announce_run(identity)

    def live_workers(self) -> dict:
        return self.inner.live_workers()

    def leave(self) -> None:
        self.inner.leave()

    def finish(self) -> None:
        self.inner.finish()

    @property
    def addresses(self) -> list[str]:
        return self.inner.addresses

    def shutdown(self) -> None:
        self.inner.shutdown()


class SkipRoundBackend(DelegatingBackend):
    """Delegates to ``inner`` except in round ``skip_round``, which fails without any traffic."""

    def __init__(self, inner: CommBackend, skip_round: int):
        super().__init__(inner)
        self.skip_round = skip_round

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        if round_index + 1 == self.skip_round:
            return SyncResult(ok=False, peers=1, total_weight=weight, error="faults.skip_round")
        return super().all_reduce_mean(
            tensors, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
        )


class ScaledPayloadBackend(DelegatingBackend):
    """Delegates to ``inner`` with every contribution multiplied by ``scale`` first: well-formed
    payloads of a worker whose vector is ``scale`` x too big (a diverged worker, or a poisoner).
    The scaling comes before the transport sees the tensors, so all it derives from them (the norm
    hivemind declares, the payloads) is of the scaled vector, as for a worker that really has it.
    A failed round leaves ``tensors`` as they were, unscaled."""

    def __init__(self, inner: CommBackend, scale: float):
        super().__init__(inner)
        self.scale = scale

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        scaled = [t * self.scale for t in tensors]
        result = self.inner.all_reduce_mean(
            scaled, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
        )
        if result.averaged:
            for tensor, mean in zip(tensors, scaled):
                tensor.copy_(mean)
        return result


class BadPayloadCodec(Codec):
    """``inner``, except that what it compresses arrives broken in the way ``mode`` names."""

    def __init__(self, inner: Codec, mode: str):
        self.inner, self.mode = inner, mode
        self.name, self.codec_id, self.align, self.gathers = inner.name, inner.codec_id, inner.align, inner.gathers
        self.lossless = False  # even "none" goes through the payload path, where the fault is

    def params(self) -> tuple[int, int]:
        return self.inner.params()

    def body_bytes(self, numel: int) -> int:
        return self.inner.body_bytes(numel)

    def _encode(self, flat: torch.Tensor) -> bytes:
        return self.inner._encode(flat)

    def _decode(self, body: memoryview, numel: int) -> torch.Tensor:
        return self.inner._decode(body, numel)

    def gathered_mean(self, contributions, numel: int) -> torch.Tensor:
        return self.inner.gathered_mean(contributions, numel)

    @property
    def reply_codec(self) -> Codec:
        return (
            self.inner.reply_codec
        )  # faults.bad_payload breaks a worker's own contributions, not the averages it serves

    def compress(self, tensor: torch.Tensor) -> bytes:
        if self.mode == "nan":
            return self.inner.compress(torch.full_like(tensor, float("nan")))
        if self.mode == "wrong_size":
            return self.inner.compress(tensor.reshape(-1)[:-1])
        payload = self.inner.compress(tensor)
        return payload[: len(payload) // 2]  # truncated


def with_bad_payloads(codec: Codec, cfg: FaultConfig, worker_index: int) -> Codec:
    """The codec this worker's transport uses: broken as ``faults.bad_payload`` says, if it applies
    (``scaled`` payloads are well-formed: ``with_faults`` makes them)."""
    broken = cfg.bad_payload not in ("", "scaled") and applies_to(cfg, worker_index)
    return BadPayloadCodec(codec, cfg.bad_payload) if broken else codec


def applies_to(cfg: FaultConfig, worker_index: int) -> bool:
    return cfg.worker in (-1, worker_index)


def with_faults(backend: CommBackend, cfg: FaultConfig, worker_index: int) -> CommBackend:
    if cfg.bad_payload == "scaled" and applies_to(cfg, worker_index):
        backend = ScaledPayloadBackend(backend, cfg.payload_scale)
    if cfg.skip_round and applies_to(cfg, worker_index):
        backend = SkipRoundBackend(backend, cfg.skip_round)
    return backend


def slow_down(cfg: FaultConfig, worker_index: int) -> None:
    """``faults.step_delay_s``: this worker computes as if on a slower machine."""
    if cfg.step_delay_s > 0 and applies_to(cfg, worker_index):
        time.sleep(cfg.step_delay_s)


def check_stop(cfg: FaultConfig, worker_index: int, rounds_done: int) -> None:
    if cfg.stop_after_round == rounds_done and applies_to(cfg, worker_index):
        raise StopRequested(f"faults.stop_after_round={rounds_done} reached")
