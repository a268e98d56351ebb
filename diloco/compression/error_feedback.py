"""Error feedback: what a lossy codec did not send this round is added to the next round's.

With a residual ``e`` (zero at first), a worker sends ``c = g + beta e`` compressed and keeps
``e = c - decompress(compress(c))``. With ``beta`` = 1 (``compression.error_decay``, the
default) the sum of what was sent tracks the sum of the pseudo-gradients to within one round's
residual, so a sparse or coarse codec delays information instead of losing it (DeMo,
SparseLoCo; EF21). Below 1, what was held back long ago weighs less (SparseLoCo decays it by
0.95 a round). The residual is this worker's own and goes into its checkpoint, never to its
peers.

With a codec chosen per round (``compression.name=adaptive``) the codec is known only once the
round's group agreed on it: ``apply`` then keeps ``c`` itself, and ``settle`` makes it the
residual of the codec the round used.
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
        self.deferred = codec.chosen_per_round  # the residual is settled once the round names its codec
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
            if self.deferred:
                residual.copy_(value)  # ``settle`` takes off what the round's codec sent
            else:
                _keep_unsent(residual, value, self.codec)
            corrected.append(value)
        return corrected

    @torch.no_grad()
    def settle(self, codec_name: str, indices: Sequence[int] | None = None) -> None:
        """After a round that averaged with a codec chosen per round (``codec_name``, one of the
        candidates): the residuals become what that codec did not send. A no-op for a fixed codec."""
        if not (self.enabled and self.deferred) or self.residuals is None:
            return
        codec = self.codec.named(codec_name)
        for index, residual in enumerate(self.residuals):
            if residual is not None and (indices is None or index in indices):
                _keep_unsent(residual, residual, codec)

    def take_back(self, sent: Sequence[torch.Tensor], raw: Sequence[torch.Tensor]) -> None:
        """A round that sent nothing (postponed): the residuals are again what ``apply`` found,
        ``sent`` (what it returned) less ``raw`` (what it was given), undecayed."""
        if not self.enabled or self.residuals is None or self.decay == 0:
            return
        for residual, value, tensor in zip(self.residuals, sent, raw):
            if residual is not None:
                residual.copy_(value.to(torch.float32).sub(tensor.to(torch.float32)).div_(self.decay))

    def forget(self, indices: Sequence[int] | None = None) -> None:
        """The last round applied the corrected tensors in full (it was not averaged): nothing is owed."""
        for index, residual in enumerate(self.residuals or []):
            if residual is not None and (indices is None or index in indices):
                residual.zero_()

    def state_dict(self) -> dict:
        """The live residuals, not copied (a checkpoint is written before the next round changes them)."""
        return {"residuals": None if self.residuals is None else list(self.residuals)}

    def load_state_dict(self, state: dict) -> None:
        residuals = state.get("residuals")
        self.residuals = None if residuals is None else [_clone(r) for r in residuals]


def _keep_unsent(residual: torch.Tensor, value: torch.Tensor, codec: Codec) -> None:
    """``residual`` becomes what ``codec`` does not carry of ``value``: zero where a diverged step
    made it non-finite (its peers drop it, and nothing is owed)."""
    restored = codec.restore(value)
    if value is not residual:
        residual.copy_(value)
    residual.sub_(restored)
    if not all_finite(residual):
        residual.zero_()


def _clone(residual: torch.Tensor | None) -> torch.Tensor | None:
    return None if residual is None else residual.clone()
