"""When a round ends: after H inner steps, or after a time budget (dynamic local steps).

With ``outer.round_s`` = 0 every worker runs ``outer.sync_every`` (H) inner steps a round and the
run is ``inner.steps`` long. With ``outer.round_s`` > 0 a round lasts that many seconds of inner
steps instead: a fast worker runs more steps, a slow one fewer, and each contribution is
weighted by the samples behind it (the round's weight). The run then has the same number of
rounds, ``ceil(inner.steps / H)``, and the learning-rate schedule follows the round's elapsed
time (round r at fraction f of its budget is schedule step (r + f) x H), so that workers of
different speeds anneal together.
"""

from __future__ import annotations

import math
import time


class RoundClock:
    def __init__(self, *, sync_every: int, round_s: float, total_steps: int):
        self.sync_every, self.round_s, self.total_steps = sync_every, round_s, total_steps
        self.total_rounds = math.ceil(total_steps / sync_every) if sync_every else 0
        self._started = time.monotonic()

    @property
    def timed(self) -> bool:
        return self.round_s > 0

    def start_round(self) -> None:
        self._started = time.monotonic()

    def _fraction(self) -> float:
        return min(1.0, (time.monotonic() - self._started) / self.round_s)

    def running(self, step: int, round_index: int) -> bool:
        """Whether the worker has inner steps left."""
        return round_index < self.total_rounds if self.timed else step < self.total_steps

    def round_ends(self, step: int) -> bool:
        """Whether the inner step just taken (``step`` done in all) ends the round."""
        if self.timed:
            return self._fraction() >= 1.0
        return step % self.sync_every == 0 or step == self.total_steps

    def schedule_step(self, step: int, round_index: int) -> int:
        """The step the learning-rate schedule sees for the next inner step."""
        if not self.timed:
            return step
        return min(self.total_steps - 1, round_index * self.sync_every + int(self._fraction() * self.sync_every))
