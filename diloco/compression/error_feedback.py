"""Error feedback: what a lossy codec did not send this round is added to the next round's.

With a residual ``e`` (zero at first), a worker sends ``c = g + e`` compressed and keeps
``e = c - decompress(compress(c))``. Over rounds, the sum of what was sent tracks the sum of
the pseudo-gradients to within one round's residual, so a sparse or coarse codec delays
information instead of losing it (DeMo, SparseLoCo; EF21). The residual is this worker's own
and goes into its checkpoint, never to its peers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diloco.compression.codec import Codec


class ErrorFeedback:
    """The residual buffers of one worker. ``enabled=False`` (or a lossless codec) is a no-op."""

    def __init__(self, codec: Codec, *, enabled: bool):
        self.codec = codec
        self.enabled = enabled and not codec.lossless
        self.residuals: list[torch.Tensor] | None = None

    @torch.no_grad()
    def apply(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors to send (each plus its residual); the residuals become what they lose in transit."""
        if not self.enabled:
            return list(tensors)
        if self.residuals is None:
            self.residuals = [torch.zeros_like(t, dtype=torch.float32) for t in tensors]
        corrected = [t.to(torch.float32) + r for t, r in zip(tensors, self.residuals, strict=True)]
        for residual, value in zip(self.residuals, corrected):
            residual.copy_(value - self.codec.restore(value))
            if not bool(torch.isfinite(residual).all()):  # a diverged step: peers drop it, owe nothing
                residual.zero_()
        return corrected

    def forget(self) -> None:
        """The last round applied the corrected tensors in full (it was not averaged): nothing is owed."""
        if self.residuals is not None:
            for residual in self.residuals:
                residual.zero_()

    def state_dict(self) -> dict:
        return {"residuals": None if self.residuals is None else [r.clone() for r in self.residuals]}

    def load_state_dict(self, state: dict) -> None:
        residuals = state.get("residuals")
        self.residuals = None if residuals is None else [r.clone() for r in residuals]
