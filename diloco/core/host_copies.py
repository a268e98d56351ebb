"""Moving the outer step's tensors between the model's device and host memory.

The outer step reads the local params once a round (the pseudo-gradient), hands CPU tensors to
the transport (codecs and hivemind work on host memory), and writes the new global params back.
With the model on a GPU each of those is a device <-> host copy of every parameter. Copies into
or out of **pinned** (page-locked) host memory run by DMA at full PCIe/NVLink-C2C speed and can be
queued without blocking (``non_blocking=True``); copies from pageable memory are staged through a
driver buffer and block the CPU per tensor. So the helpers here queue every copy of a round
first and wait once, at the one point where the host needs the bytes.

On a CPU-only model every helper reduces to the plain copies the outer step always made, so
results there stay bit-identical to before.

    staged = to_host(local_params)                  # fp32 CPU tensors, pinned when from a GPU
    global_params = global_copy(local_params, torch.device("cpu"))   # pinned when the model is on CUDA
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

GLOBAL_DEVICES = ("cpu", "model")


def on_cuda(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the tensors live on a CUDA device (they are one model's params: one device)."""
    return bool(tensors) and tensors[0].is_cuda


def global_copy(local_params: Sequence[torch.Tensor], where: str) -> list[torch.Tensor]:
    """fp32 copies of ``local_params`` for the outer step: on the model's device (``where="model"``),
    or in host memory (``"cpu"``), pinned when the model is on CUDA so that copies back and forth
    need not block."""
    if where == "model" or not on_cuda(local_params):
        return [p.detach().to(p.device if where == "model" else "cpu", torch.float32, copy=True) for p in local_params]
    copies = [torch.empty(p.shape, dtype=torch.float32, pin_memory=True) for p in local_params]
    for copy, param in zip(copies, local_params):
        copy.copy_(param.detach(), non_blocking=True)
    torch.cuda.current_stream(local_params[0].device).synchronize()  # the host may read them at once
    return copies


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh fp32 CPU copies of ``tensors``. From a GPU: pinned buffers (PyTorch caches them from
    round to round), every copy queued before a single wait."""
    if not on_cuda(tensors):
        return [t.detach().to("cpu", torch.float32) for t in tensors]
    host = [torch.empty(t.shape, dtype=torch.float32, pin_memory=True) for t in tensors]
    for buffer, tensor in zip(host, tensors):
        buffer.copy_(tensor.detach(), non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()  # the one sync of the round's read
    return host


def to_device(tensors: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the devices of ``like`` (no copy where they already are); queued, not awaited:
    later work on the same CUDA stream runs after the copies."""
    return [t.to(target.device, non_blocking=True) for t, target in zip(tensors, like)]


class CopyFence:
    """Marks queued device copies that read host memory, so that the host does not overwrite that
    memory before they are done (a non-blocking copy from pinned memory reads it later)."""

    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None

    def mark(self, device: torch.device) -> None:
        """Call after queueing copies on ``device``'s current stream (no-op on CPU)."""
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        """Block until the marked copies are done; call before writing their host source."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None


def state_to_cpu(state, *, copy: bool = False):
    """A (nested) state dict with every tensor on the CPU: checkpoints and the state served to peers
    then load on any machine, whatever device the outer step ran on. With ``copy``, a snapshot:
    every tensor copied, so that later changes to the live state cannot reach it (containers are
    rebuilt, other values shared: numbers, strings, fresh RNG states)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=copy)
    if isinstance(state, dict):
        return {key: state_to_cpu(value, copy=copy) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(state_to_cpu(value, copy=copy) for value in state)
    return state
