"""Error feedback: what a lossy codec did not send this round is added to the next round's.

With a residual ``e`` (zero at first), a worker sends ``c = g + beta e`` compressed and keeps
``e = c - decompress(compress(c))``. With ``beta`` = 1 (``compression.error_decay``, the
default) the sum of what was sent tracks the sum of the pseudo-gradients to within one round's
residual, so a sparse or coarse codec delays information instead of losing it (DeMo,
SparseLoCo; EF21). Below 1, what was held back long ago weighs less (SparseLoCo decays it by
0.95 a round). The residual is this worker's own and goes into its checkpoint, never to its
peers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diloco.compression.codec import Codec, all_finite


class ErrorFeedback:
    """The residual buffers of one worker. ``enabled=False`` (or a lossless codec) is a no-op.

    Tensors are identified by their index in the model's parameter list (``indices``; default
    0..n-1), so that fragments of the parameters (streaming) each keep their own residuals.
    """

    def __init__(self, codec: Codec, *, enabled: bool, decay: float = 1.0):
        self.codec, self.decay = codec, decay
        self.enabled = enabled and not codec.lossless
        self.residuals: list[torch.Tensor | None] | None = None

    @torch.no_grad()
    def apply(self, tensors: Sequence[torch.Tensor], indices: Sequence[int] | None = None) -> list[torch.Tensor]:
        """The tensors to send (each plus its residual); the residuals become what they lose in transit."""
        if not self.enabled:
            return list(tensors)
        indices = range(len(tensors)) if indices is None else indices
        if self.residuals is None:
            self.residuals = []
        self.residuals.extend([None] * (max(indices, default=-1) + 1 - len(self.residuals)))
        corrected = []
        for index, tensor in zip(indices, tensors, strict=True):
            residual = self.residuals[index]
            if residual is None:
                residual = self.residuals[index] = torch.zeros_like(tensor, dtype=torch.float32)
            value = tensor.to(torch.float32).add(residual, alpha=self.decay)
            residual.copy_(value - self.codec.restore(value))
            if not all_finite(residual):  # a diverged step: peers drop it, owe nothing
                residual.zero_()
            corrected.append(value)
        return corrected

    def forget(self, indices: Sequence[int] | None = None) -> None:
        """The last round applied the corrected tensors in full (it was not averaged): nothing is owed."""
        for index, residual in enumerate(self.residuals or []):
            if residual is not None and (indices is None or index in indices):
                residual.zero_()

    def state_dict(self) -> dict:
        return {"residuals": None if self.residuals is None else [_clone(r) for r in self.residuals]}

    def load_state_dict(self, state: dict) -> None:
        residuals = state.get("residuals")
        self.residuals = None if residuals is None else [_clone(r) for r in residuals]


def _clone(residual: torch.Tensor | None) -> torch.Tensor | None:
    return None if residual is None else residual.clone()
