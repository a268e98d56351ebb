"""A worker's held-out loss after each round: the loop's ``evaluate()``, or its ``batch_losses``, the
loss of each held-out batch, which the workers holding the same params split between them where
the transport offers a board to share them on (core/shared_evaluation.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from diloco.comm.base import CommBackend, SyncResult
from diloco.core.evaluation import mean_loss
from diloco.core.shared_evaluation import round_loss
from diloco.errors import UsageError


class HeldOutLoss:
    """``evaluate()``, the whole evaluation; ``batch_losses(indices)``, the losses of those of the
    ``eval_batches`` held-out batches, in order. Either or both (``evaluate`` then serves where the
    batches are not split); neither: no held-out loss."""

    def __init__(
        self,
        evaluate: Callable[[], float | None] | None,
        batch_losses: Callable[[list[int]], Sequence[float]] | None,
        eval_batches: int,
    ):
        if batch_losses is not None and eval_batches < 1:
            raise UsageError(f"batch_losses needs eval_batches, the number of held-out batches (got {eval_batches})")
        if batch_losses is None and eval_batches:
            raise UsageError("eval_batches counts the batches of batch_losses: pass batch_losses too, or drop it")
        self.evaluate, self.batch_losses, self.count = evaluate, batch_losses, eval_batches

    @property
    def given(self) -> bool:
        return self.evaluate is not None or self.batch_losses is not None

    def after_round(
        self, backend: CommBackend, result: SyncResult, *, declared: bool, worker: int, round_done: int, digest: str
    ) -> tuple[float | None, int | None]:
        """The loss after round ``round_done``, and how many batches this worker evaluated for it
        (None: not counted): split among the workers that averaged the round together where the
        worker ``declared`` its params' ``digest`` and ``backend`` offers a board, else alone."""
        board = backend.board
        if self.batch_losses is None or board is None or not (declared and result.averaged and result.peers > 1):
            return self.whole()
        split = round_loss(
            self._losses_of,
            self.count,
            board=board,
            declared=backend.membership.declared_params,
            worker=worker,
            round_done=round_done,
            digest=digest,
            expected=result.sides[0] if result.sides else result.peers,  # a group of two models: ours only
        )
        return split.val_loss, split.evaluated

    def whole(self) -> tuple[float | None, int | None]:
        """The loss by this worker alone: ``evaluate()``, else every batch's; and the batches it counted."""
        if self.evaluate is not None:
            return self.evaluate(), None
        indices = list(range(self.count))
        return mean_loss(self._losses_of(indices)), len(indices)

    def _losses_of(self, indices: list[int]) -> list[float]:
        losses = list(self.batch_losses(indices))
        if len(losses) != len(indices):
            raise UsageError(
                f"batch_losses({indices}) returned {len(losses)} losses: return one loss per index given, in order"
            )
        return [float(loss) for loss in losses]
