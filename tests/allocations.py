"""Counting what torch allocates on the CPU inside a block, and the most of it alive at once.

    with NewTensors() as new:
        outer.sync(...)
    assert new.peak_bytes < params_bytes / 4

A dispatch mode sees every operation of the calling thread: an output whose memory is none of
its inputs' is a new allocation (views, in-place and ``out=`` operations are not), counted until
the tensor is freed. Tensors made before the block (the model, the global params) are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class NewTensors(TorchDispatchMode):
    """The bytes of CPU tensors allocated in the block and still alive (``live_bytes``), and the
    most that were alive at once (``peak_bytes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        known = {_memory(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and _memory(tensor) not in known:
                size = tensor.untyped_storage().nbytes()
                self.live_bytes += size
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                weakref.finalize(tensor, self._freed, size)
        return out

    def _freed(self, size: int) -> None:
        self.live_bytes -= size


def _memory(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
