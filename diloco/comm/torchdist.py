"""Averaging with ``torch.distributed``: for datacenter runs, and the classic DDP baseline.

One process per worker, launched by torchrun, which sets RANK, WORLD_SIZE and the rendezvous
address; gloo on CPU, NCCL when the workers train on CUDA::

    torchrun --standalone --nproc-per-node 4 -m diloco.cli train configs/tiny.yaml comm.backend=torchdist

``diloco train`` takes ``worker.index`` and ``worker.count`` from RANK and WORLD_SIZE. A round is
one all-reduce of the weighted, flattened pseudo-gradients: every rank ends with the same bytes
(ring all-reduce reduces each chunk once). Bytes are counted as a ring all-reduce moves them,
2 (n-1)/n of the payload each way.

With a lossy codec (``compression.name``) the workers all-gather their compressed payloads
instead and each decodes and averages them in rank order (``average_payloads``), so every rank
computes the same mean from the same bytes; a ring all-gather sends (n-1) payloads a worker.
Either way every rank screens the same norms alike (``robust.screen``; for fp32 the ranks first
all-gather their norm and weight, two numbers each): a rank whose norm is not finite or far
above the median is left out of the mean (with ``comm.clip_to_median``, one above it is scaled
down). The fp32 all-reduce checks nothing else; a run that asks for the screening by direction
(``comm.min_cosine``, which needs every contribution whole) is refused by the config check. Unlike
hivemind, a dead peer fails the whole group: this transport is for reliable links.
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from diloco.comm.base import Averaging, CommBackend, Outcome, SyncResult
from diloco.comm.config import CommConfig
from diloco.comm.reduce import Contribution, Verdicts, average_payloads
from diloco.comm.robust import ScreeningRules, screen
from diloco.comm.scores import Scores
from diloco.compression import Codec

logger = logging.getLogger(__name__)


class TorchDistBackend(CommBackend):
    """A rank's transport under torchrun: it only averages (``TorchDistAveraging``); shutting it
    down destroys the process group it started."""

    def __init__(self, cfg: CommConfig, *, num_workers: int, worker_index: int, device: torch.device, codec: Codec):
        if not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                timeout=datetime.timedelta(seconds=cfg.deadline_s),
            )
        self._owns_group = True
        if dist.get_world_size() != num_workers or dist.get_rank() != worker_index:
            raise ValueError(
                f"torch.distributed has rank {dist.get_rank()} of {dist.get_world_size()} but the config says "
                f"worker.index={worker_index}, worker.count={num_workers}"
            )
        super().__init__(TorchDistAveraging(cfg, num_workers=num_workers, device=device, codec=codec))

    def shutdown(self) -> None:
        if self._owns_group and dist.is_initialized():
            self._owns_group = False
            dist.destroy_process_group()


class TorchDistAveraging(Averaging):
    averages_in_background = True

    def __init__(self, cfg: CommConfig, *, num_workers: int, device: torch.device, codec: Codec):
        self.device, self.codec, self.num_workers = device, codec, num_workers
        self.rules = ScreeningRules.of(cfg)  # by norm and weight (a run that screens by direction is refused)
        # by rank: every rank sees the same, and decides alike
        self.scores = Scores(self.rules.exclude_after, self.rules.readmit_after)

    @torch.no_grad()
    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        if not self.codec.lossless:
            return self._all_gather_compressed(tensors, weight, round_index)
        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float32) for t in tensors])
        norm = torch.linalg.vector_norm(flat, dtype=torch.float64)
        mine = torch.stack([norm, torch.tensor(float(weight), dtype=torch.float64, device=self.device)])
        stats = [torch.zeros(2, dtype=torch.float64, device=self.device) for _ in range(self.num_workers)]
        try:
            dist.all_gather(stats, mine)
        except RuntimeError as error:  # a peer died or timed out: the group is unusable
            return SyncResult(Outcome.FAILED, 1, weight, error=f"torch.distributed: {error}".splitlines()[0])
        norms, weights = zip(*(s.tolist() for s in stats))
        taken = [rank for rank in range(self.num_workers) if not self.scores.is_excluded(f"rank {rank}")]
        screening = screen({r: norms[r] for r in taken}, self.rules, {r: weights[r] for r in taken})
        for rank, reason in sorted(screening.dropped.items()):
            logger.warning("round %d: dropped the contribution of rank %d: %s", round_index + 1, rank, reason)
        self._record(
            round_index,
            [f"rank {r}" for r in range(self.num_workers)],
            {f"rank {r}": reason for r, reason in screening.dropped.items()},
            [f"rank {r}" for r, scale in screening.scales.items() if scale != 1.0],
        )
        kept = sorted(screening.scales)
        total = sum(screening.weight(weights[rank]) for rank in kept)
        if not kept or not (math.isfinite(total) and total > 0):  # every rank sees the same and gives up alike
            return SyncResult(Outcome.FAILED, 1, weight, error="every contribution was dropped")
        rank = dist.get_rank()
        if rank in screening.scales:
            flat.mul_(screening.weight(weight) * screening.scales[rank])
        else:
            flat.zero_()  # not multiplied: NaN x 0 is NaN
        try:
            dist.all_reduce(flat)
        except RuntimeError as error:
            return SyncResult(Outcome.FAILED, 1, weight, error=f"torch.distributed: {error}".splitlines()[0])
        flat.div_(total)
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            tensor.copy_(flat[offset : offset + n].view_as(tensor))
            offset += n
        payload = flat.numel() * 4
        volume = int(2 * (self.num_workers - 1) / self.num_workers * payload)
        return SyncResult(
            Outcome.AVERAGED, len(kept), total, bytes_sent=volume, bytes_recv=volume, excluded=self._excluded()
        )

    def _all_gather_compressed(self, tensors: Sequence[torch.Tensor], weight: float, round_index: int) -> SyncResult:
        numels = [t.numel() for t in tensors]
        payloads = [self.codec.compress(t) for t in tensors]
        mine = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).to(self.device)
        try:
            lengths = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.num_workers)]
            dist.all_gather(lengths, torch.tensor([mine.numel()], dtype=torch.int64, device=self.device))
            longest = int(max(length.item() for length in lengths))
            gathered = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.num_workers)]
            dist.all_gather(gathered, torch.nn.functional.pad(mine, (0, longest - mine.numel())))
            weights = [torch.zeros(1, dtype=torch.float64, device=self.device) for _ in range(self.num_workers)]
            dist.all_gather(weights, torch.tensor([float(weight)], dtype=torch.float64, device=self.device))
        except RuntimeError as error:
            return SyncResult(Outcome.FAILED, 1, weight, error=f"torch.distributed: {error}".splitlines()[0])
        ranks = [f"rank {rank}" for rank in range(self.num_workers)]
        contributions = [
            Contribution(
                ranks[rank],
                _split(gathered[rank][: int(lengths[rank].item())].cpu().numpy().tobytes(), self.codec, numels),
                weights[rank].item(),
            )
            for rank in range(self.num_workers)
            if not self.scores.is_excluded(ranks[rank])
        ]
        verdicts = Verdicts()
        means, used = average_payloads(
            self.codec, contributions, numels, round_index=round_index, rules=self.rules, verdicts=verdicts
        )
        self._record(round_index, ranks, verdicts.left_out, verdicts.clipped)
        if not used:
            return SyncResult(Outcome.FAILED, 1, weight, error="every contribution was dropped")
        for tensor, mean in zip(tensors, means):
            tensor.copy_(mean.view_as(tensor))
        volume = (self.num_workers - 1) * mine.numel()
        return SyncResult(
            Outcome.AVERAGED,
            len(used),
            sum(c.weight for c in used),
            bytes_sent=volume,
            bytes_recv=volume,
            excluded=self._excluded(),
        )

    def _record(self, round_index: int, sent: list[str], left_out: dict[str, str], clipped) -> None:
        self.scores.record_round(sent, left_out, clipped, context=f"round {round_index + 1}: ")

    def _excluded(self) -> tuple[int, ...]:
        return tuple(sorted(int(who.split()[1]) for who in self.scores.excluded()))


def _split(data: bytes, codec: Codec, numels: Sequence[int]) -> list[bytes]:
    """One rank's concatenated payloads, cut where ``codec`` says each ends; data of the wrong
    total length comes back as one piece, which ``average_payloads`` rejects (wrong count)."""
    sizes = [codec.payload_bytes(numel) for numel in numels]
    if sum(sizes) != len(data):
        return [data]
    pieces, offset = [], 0
    for size in sizes:
        pieces.append(data[offset : offset + size])
        offset += size
    return pieces
