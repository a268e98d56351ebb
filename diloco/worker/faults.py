"""Fault injection at named points, for tests and the fault and attack benchmarks (as torchft does).

    diloco train ... faults.skip_round=2        # sit out round 2's averaging, as if the link dropped
    diloco train ... faults.stop_after_round=3  # exit right after round 3's checkpoint, as if killed
    diloco local ... faults.worker=1 faults.skip_round=2   # only worker 1 of a local run
    diloco local ... faults.worker=1 faults.bad_payload=nan  # worker 1 sends NaN payloads
    diloco local ... faults.worker=1 faults.step_delay_s=0.2  # worker 1 computes like a slower machine
    diloco local ... faults.step_delay_s=0.2 faults.step_delay_until=/tmp/go  # ... until /tmp/go exists
    diloco local ... faults.worker=1 faults.bad_payload=scaled  # worker 1 sends 100 x its pseudo-gradient
    diloco local ... faults.worker=1 faults.bad_payload=noise  # worker 1 sends noise of its pseudo-gradient's norm
    diloco local ... faults.worker=1 faults.bad_payload=replay  # worker 1 sends its last round's one again
    diloco local ... faults.worker=6 faults.count=2 ...  # workers 6 and 7 alike
    diloco local ... faults.worker=1 faults.weight_scale=1000  # worker 1 claims 1000 x its samples
    diloco train ... faults.poison_state=true  # offers its state with other params, claiming a huge group
    diloco train ... faults.corrupt_state_range=true  # serves corrupt parts of its state to a downloading peer

Faults wrap the real parts; nothing else in the code knows about them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import torch

from diloco.comm.base import (
    Averaging,
    CommBackend,
    Outcome,
    PeerState,
    StateExchange,
    StateRank,
    StateReader,
    SyncResult,
)
from diloco.compression import Codec
from diloco.config import FaultConfig
from diloco.config.schema import FORGED_PAYLOADS

# what a forging worker sends instead of its contribution: (tensors, round index, fragment) -> tensors
Forgery = Callable[[Sequence[torch.Tensor], int, int], list[torch.Tensor]]


class StopRequested(Exception):
    """Raised by ``faults.stop_after_round`` to end the worker as if it had been killed."""


class FaultyAveraging(Averaging):
    """Averages through ``inner``; a fault overrides ``all_reduce_mean`` to break it. Whether the
    averaging is simulated or runs in the background is ``inner``'s."""

    def __init__(self, inner: Averaging):
        self.inner = inner
        self.simulated, self.averages_in_background = inner.simulated, inner.averages_in_background


class SkipRoundAveraging(FaultyAveraging):
    """Averages through ``inner`` except in round ``skip_round``, which fails without any traffic."""

    def __init__(self, inner: Averaging, skip_round: int):
        super().__init__(inner)
        self.skip_round = skip_round

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        if round_index + 1 == self.skip_round:
            return SyncResult(Outcome.FAILED, peers=1, total_weight=weight, error="faults.skip_round")
        return self.inner.all_reduce_mean(
            tensors, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
        )


class ForgedPayloadAveraging(FaultyAveraging):
    """Averages through ``inner`` what ``forge`` makes of this worker's contribution instead of the
    contribution itself: well-formed payloads of a worker whose vector is wrong (a diverged worker,
    or a poisoner). The forgery comes before the transport sees the tensors, so all it derives from
    them (the norm hivemind declares, the payloads) is of the forged vector, as for a worker that
    really has it. A failed round leaves ``tensors`` as they were."""

    def __init__(self, inner: Averaging, forge: Forgery):
        super().__init__(inner)
        self.forge = forge

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        forged = self.forge(tensors, round_index, fragment)
        result = self.inner.all_reduce_mean(
            forged, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
        )
        if result.averaged:
            for tensor, mean in zip(tensors, forged):
                tensor.copy_(mean)
        return result


def scaled(scale: float) -> Forgery:
    """``faults.bad_payload=scaled``: ``scale`` x the contribution (0: a free rider's zeros)."""
    return lambda tensors, round_index, fragment: [t * scale for t in tensors]


def noise(seed: int) -> Forgery:
    """``faults.bad_payload=noise``: Gaussian noise of the contribution's own norm, new each round."""

    def forge(tensors: Sequence[torch.Tensor], round_index: int, fragment: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + round_index * 1_009 + fragment)
        draws = [torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t) for t in tensors]
        norm = torch.sqrt(sum(t.double().square().sum() for t in tensors))
        noise_norm = torch.sqrt(sum(d.double().square().sum() for d in draws))
        return [d * float(norm / noise_norm.clamp_min(1e-30)) for d in draws]

    return forge


def replayed() -> Forgery:
    """``faults.bad_payload=replay``: the contribution this worker sent the round before (its real
    one in its first round): work it did not do this round, passed off as new."""
    sent: dict[int, list[torch.Tensor]] = {}  # fragment -> what was sent last

    def forge(tensors: Sequence[torch.Tensor], round_index: int, fragment: int) -> list[torch.Tensor]:
        last = sent.get(fragment)
        sent[fragment] = [t.detach().clone() for t in tensors]
        return [t.clone() for t in last] if last is not None else [t.clone() for t in tensors]

    return forge


class ClaimedWeightAveraging(FaultyAveraging):
    """Averages through ``inner`` claiming ``scale`` x its real weight (the samples it trained on):
    a worker that wants its contribution to count for more than it is worth."""

    def __init__(self, inner: Averaging, scale: float):
        super().__init__(inner)
        self.scale = scale

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        return self.inner.all_reduce_mean(
            tensors, weight * self.scale, round_index=round_index, deadline_s=deadline_s, fragment=fragment
        )


class PoisonedStateOffers(StateExchange):
    """Offers ``inner``'s state with every global param shifted by 1, ranked as if averaged by a
    group of 999 (the most an offer can claim; a key holder that wants newcomers and lagging
    workers to take its params); it trains, averages and fetches states as ``inner`` does."""

    RANK = StateRank(999, 0.999)

    def __init__(self, inner: StateExchange):
        self.inner = inner

    def publish_state(self, round_index: int, rank: StateRank, state: StateReader) -> None:
        def poisoned(use):
            return state(lambda live: use({**live, "global_params": [p + 1.0 for p in live["global_params"]]}))

        self.inner.publish_state(round_index, self.RANK, poisoned)

    def fetch_state(self, round_index: int, **kwargs) -> PeerState | None:
        return self.inner.fetch_state(round_index, **kwargs)

    def sole_state_source(self) -> bool:
        return self.inner.sole_state_source()


class CorruptStateParts(StateExchange):
    """Offers ``inner``'s state, but every part of it a peer downloads in parts has one byte
    flipped (what a broken disk or link, or a peer that wants to spoil a newcomer, sends); the
    manifest it serves, and the state whole, are right. It trains, averages and fetches states
    as ``inner`` does."""

    def __init__(self, inner: StateExchange):
        self.inner = inner

    def publish_state(self, round_index: int, rank: StateRank, state: StateReader) -> None:
        def corrupted(use):
            read = state(use)
            if not isinstance(read, bytes) or not read:  # parts are read as bytes (state_serving.py)
                return read
            flipped = bytearray(read)
            flipped[len(flipped) // 2] ^= 0xFF
            return bytes(flipped)

        self.inner.publish_state(round_index, rank, corrupted)

    def fetch_state(self, round_index: int, **kwargs) -> PeerState | None:
        return self.inner.fetch_state(round_index, **kwargs)

    def sole_state_source(self) -> bool:
        return self.inner.sole_state_source()


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
    (forged payloads are well-formed: ``with_faults`` makes them)."""
    broken = cfg.bad_payload not in ("", *FORGED_PAYLOADS) and applies_to(cfg, worker_index)
    return BadPayloadCodec(codec, cfg.bad_payload) if broken else codec


def applies_to(cfg: FaultConfig, worker_index: int) -> bool:
    """Whether the faults are this worker's: ``faults.worker`` and the ``faults.count - 1`` after it."""
    return cfg.worker == -1 or cfg.worker <= worker_index < cfg.worker + cfg.count


def _forgery(cfg: FaultConfig, worker_index: int) -> Forgery | None:
    if cfg.bad_payload == "scaled":
        return scaled(cfg.payload_scale)
    if cfg.bad_payload == "noise":
        return noise(worker_index)
    if cfg.bad_payload == "replay":
        return replayed()
    return None


def with_faults(backend: CommBackend, cfg: FaultConfig, worker_index: int) -> CommBackend:
    """``backend`` with its averaging (and its state offers) broken as ``faults.*`` say, if they apply
    to this worker."""
    if not applies_to(cfg, worker_index):
        return backend
    averaging = backend.averaging
    if (forge := _forgery(cfg, worker_index)) is not None:
        averaging = ForgedPayloadAveraging(averaging, forge)
    if cfg.weight_scale != 1.0:
        averaging = ClaimedWeightAveraging(averaging, cfg.weight_scale)
    if cfg.skip_round:
        averaging = SkipRoundAveraging(averaging, cfg.skip_round)
    states = PoisonedStateOffers(backend.states) if cfg.poison_state else backend.states
    states = CorruptStateParts(states) if cfg.corrupt_state_range else states
    if averaging is backend.averaging and states is backend.states:
        return backend
    return backend.with_parts(averaging=averaging, states=states)


def slow_down(cfg: FaultConfig, worker_index: int) -> None:
    """``faults.step_delay_s``: this worker computes as if on a slower machine, until the file
    ``faults.step_delay_until`` names exists (a benchmark's paced run, released once its fault is
    over)."""
    if cfg.step_delay_s <= 0 or not applies_to(cfg, worker_index):
        return
    if not (cfg.step_delay_until and os.path.exists(cfg.step_delay_until)):
        time.sleep(cfg.step_delay_s)


def check_stop(cfg: FaultConfig, worker_index: int, rounds_done: int) -> None:
    if cfg.stop_after_round == rounds_done and applies_to(cfg, worker_index):
        raise StopRequested(f"faults.stop_after_round={rounds_done} reached")
