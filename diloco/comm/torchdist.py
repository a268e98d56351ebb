"""Averaging with ``torch.distributed``: for datacenter runs, and the classic DDP baseline.

One process per worker, launched by torchrun, which sets RANK, WORLD_SIZE and the rendezvous
address; gloo on CPU, NCCL when the workers train on CUDA::

    torchrun --standalone --nproc-per-node 4 -m diloco.cli train configs/tiny.yaml comm.backend=torchdist

``diloco train`` takes ``worker.index`` and ``worker.count`` from RANK and WORLD_SIZE. A round is
one all-reduce of the weighted, flattened pseudo-gradients: every rank ends with the same bytes
(ring all-reduce reduces each chunk once). Bytes are counted as a ring all-reduce moves them,
2 (n-1)/n of the payload each way. Unlike hivemind, a dead peer fails the whole group: this
transport is for reliable links.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from diloco.comm.base import CommBackend, CommConfig, SyncResult

logger = logging.getLogger(__name__)


class TorchDistBackend(CommBackend):
    def __init__(self, cfg: CommConfig, *, num_workers: int, worker_index: int, device: torch.device):
        self.device = device
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
        self.num_workers = num_workers

    @torch.no_grad()
    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float
    ) -> SyncResult:
        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float32) for t in tensors])
        flat.mul_(weight)
        total = torch.tensor([float(weight)], dtype=torch.float64, device=self.device)
        try:
            dist.all_reduce(flat)
            dist.all_reduce(total)
        except RuntimeError as error:  # a peer died or timed out: the group is unusable
            return SyncResult(False, 1, weight, error=f"torch.distributed: {error}".splitlines()[0])
        flat.div_(total.item())
        offset = 0
        for tensor in tensors:
            n = tensor.numel()
            tensor.copy_(flat[offset : offset + n].view_as(tensor))
            offset += n
        payload = flat.numel() * 4
        volume = int(2 * (self.num_workers - 1) / self.num_workers * payload)
        return SyncResult(True, self.num_workers, total.item(), bytes_sent=volume, bytes_recv=volume)

    def shutdown(self) -> None:
        if self._owns_group and dist.is_initialized():
            self._owns_group = False
            dist.destroy_process_group()
