"""The reducer of a peer's share of the all-reduce: hivemind's ``TensorPartReducer``, which sums
each part of the share over the group's senders as they arrive, changed in two ways.

- ``SenderlessEndingReducer`` also ends when no sender is left to wait for (stock hivemind then
  waits out the whole all-reduce timeout).
- ``ScreeningReducer`` holds each part's contributions until the part is complete and leaves out
  those of the senders this peer excludes (``exclusion.py``). A part is reduced in one place only
  and its average sent to every sender, so every peer receives the same decision. (Whole
  contributions are judged before anything is sent, from their declared sketches: ``verdicts.py``.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.partition import BannedException, TensorPartReducer


class SenderlessEndingReducer(TensorPartReducer):
    """hivemind's reducer of our share, which also ends once no sender is left to wait for.

    When the last senders of a part fail before sending it (a peer cut off, or every peer but one
    whose own contribution was dropped), hivemind's reducer closes that part with nobody in it and
    opens the next one expecting no sender, and never checks again: its ``finished`` event never
    fires, and the round waits for the all-reduce's whole timeout (``comm.deadline_s``) while the
    others have long gone on. A worker whose own contribution every peer dropped waits for exactly
    that event before its round can end (``_communicate_with_peer``)."""

    def __init__(self, part_shapes, num_senders: int):
        self.contributions: dict[int, int] = {}  # part -> how many senders its average is over
        super().__init__(part_shapes, num_senders)

    def kept_in(self, part_index: int) -> frozenset[int] | None:
        """The senders (indices) whose contributions to a complete part count in its average;
        None: every one that sent it."""
        return None

    def check_current_part_finished(self):
        if self.current_part_accumulated_from == self.num_current_senders:
            self.contributions[self.current_part_index] = self.current_part_accumulated_from
        super().check_current_part_finished()

    def on_sender_failed(self, sender_index: int):
        super().on_sender_failed(sender_index)
        if not self.finished.is_set() and self.num_current_senders == 0:
            self.finalize()


class ScreeningReducer(SenderlessEndingReducer):
    """A reducer that leaves the senders our tally excludes out of each part of its share (see the
    module's docstring); ``contributions`` counts only the kept ones (a part with a sender left out
    is of fewer workers, as the senders' round records then say)."""

    def __init__(self, part_shapes, num_senders: int, excluded: frozenset = frozenset()):
        self.excluded = excluded  # sender indices left out of every part
        self._held: dict[int, tuple[torch.Tensor, float]] = {}  # the current part: sender -> (values, weight)
        self._kept_in: dict[int, frozenset[int]] = {}  # part -> senders kept in it
        super().__init__(part_shapes, num_senders)

    def kept_in(self, part_index: int) -> frozenset[int] | None:
        return self._kept_in[part_index]  # asked once the part is complete: a KeyError is a bug

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """As hivemind's (the same waiting and banning), except that the part is held, not summed."""
        if not (0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts):
            raise AllreduceException(f"sender {sender_index} sent part {part_index}: out of range")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # the parts before it are not averaged yet
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        if part_index != self.current_part_index:  # an old part again: it would be held as the current one
            raise AllreduceException(f"sender {sender_index} sent part {part_index} again")
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self._held[sender_index] = (tensor_part, weight)
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self):
        part, kept = self.current_part_index, None
        if self.current_part_accumulated_from == self.num_current_senders:
            self.accumulator, self.denominator, kept = self._screened_sum()
        super().check_current_part_finished()
        if kept is not None:  # the senders' records count the contributions in the part's average
            self.contributions[part] = kept

    def _screened_sum(self) -> tuple[torch.Tensor, float, int]:
        """The weighted sum of the current part's kept contributions (in sender order), their
        weight, and how many they are."""
        held, self._held = self._held, {}
        kept = sorted(sender for sender in held if sender not in self.excluded)
        total = torch.zeros(self.part_shapes[self.current_part_index])
        weight = 0.0
        for sender in kept:
            total.add_(held[sender][0], alpha=held[sender][1])
            weight += held[sender][1]
        self._kept_in[self.current_part_index] = frozenset(kept)
        return total, weight, len(kept)


def reducer_for(part_shapes: Sequence[torch.Size], num_senders: int, *, excluded: frozenset = frozenset()):
    """The reducer of our share: one that leaves out the senders our tally excludes (their
    indices), if any. A codec that gathers is not averaged by the reducer, but screened alike: each
    recipient takes its mean of the senders the reducer kept (``kept_in``)."""
    if not excluded:
        return SenderlessEndingReducer(part_shapes, num_senders)
    return ScreeningReducer(part_shapes, num_senders, excluded)
