"""What an averager counts on the wire and in its rounds, shared with the worker's process.

Every averaging message sent and received is counted in bytes, so a round reports traffic measured
on the wire rather than estimated; beside them, the values whose reducer failed, the contributions
each part was averaged over, the codec the last all-reduce used, the time spent in all-reduces, and
the groups and reducers lost. The averager's process adds; the worker reads (``averaging.py``).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp

_NOT_SEEN = 1 << 40


class TrafficCounters:
    """Running totals shared between the averager's process and the worker's.

    Totals only grow: a reducer may still be sending its last replies when the worker's own
    step has returned, so a round's traffic is read as the difference between two readings
    and late bytes are counted in the next one, never lost.
    """

    def __init__(self):
        self._sent = mp.Value(ctypes.c_int64, 0)
        self._recv = mp.Value(ctypes.c_int64, 0)
        self._failed_values = mp.Value(ctypes.c_int64, 0)
        self._own_drops = mp.Value(ctypes.c_int64, 0)
        self._serving = mp.Value(ctypes.c_int64, 0)  # senders this peer is still streaming averaged parts to
        self._least = mp.Value(ctypes.c_int64, _NOT_SEEN)  # the fewest contributions in a part of this round
        self._most = mp.Value(ctypes.c_int64, 0)  # the most
        self._transfer_us = mp.Value(ctypes.c_int64, 0)  # time in all-reduces, from the group's start to our end
        self._codec = mp.Value(ctypes.c_int64, 0)  # the candidate the last all-reduce used (codec.candidates)
        self._left_behind = mp.Value(ctypes.c_int64, 0)  # groups that broke for a member that had left them
        self._lost_reducers = mp.Value(ctypes.c_int64, 0)  # other members whose averaged parts never all came

    def add(
        self,
        *,
        sent: int = 0,
        recv: int = 0,
        failed_values: int = 0,
        own_drops: int = 0,
        lost_reducers: int = 0,
        transfer_s: float = 0.0,
    ) -> None:
        for counter, amount in (
            (self._sent, sent),
            (self._recv, recv),
            (self._failed_values, failed_values),
            (self._own_drops, own_drops),
            (self._lost_reducers, lost_reducers),
            (self._transfer_us, round(transfer_s * 1e6)),
        ):
            if amount:
                with counter.get_lock():
                    counter.value += amount

    def note_contributions(self, count: int) -> None:
        """A part of this round's mean (ours or a reducer's) was averaged over ``count`` contributions."""
        with self._least.get_lock():
            self._least.value = min(self._least.value, count)
            self._most.value = max(self._most.value, count)

    def take_contributions(self) -> tuple[int, int] | None:
        """The fewest and the most contributions the parts of the round since the last call were
        averaged over (None: no part said), and start counting afresh."""
        with self._least.get_lock():
            least, most = self._least.value, self._most.value
            self._least.value, self._most.value = _NOT_SEEN, 0
        return None if least == _NOT_SEEN else (least, most)

    def serving(self, change: int = 0) -> int:
        """Reply streams to senders still open (after adding ``change``). A peer whose own round is
        over may still be sending a sender its averaged parts: it must not shut down before."""
        with self._serving.get_lock():
            self._serving.value += change
            return self._serving.value

    def used_codec(self, index: int | None = None) -> int:
        """The index (in ``Codec.candidates``) of the codec the last all-reduce used, after setting it."""
        if index is not None:
            self._codec.value = index
        return self._codec.value

    def groups_left_behind(self, change: int = 0) -> int:
        """Groups so far (after adding ``change``) that broke because a member had given up on them
        before they formed (its leader's answer came late): we refused their parts
        (``ExactAverager.rpc_aggregate_part``), or a reducer refused ours. Their peers retry. Only a
        member that reduces a share over hivemind refuses: a late client, or a group averaged over
        the gloo data plane, fails as any broken group does."""
        with self._left_behind.get_lock():
            self._left_behind.value += change
            return self._left_behind.value

    def reducers_lost(self) -> int:
        """Other members of our groups so far whose averaged parts never all came back to us inside
        an all-reduce: a member that crashed or was cut off from us (or stalled past its timeout,
        or sent what we could not read), counted once its all-reduce is over. A retry among the
        survivors expects that many fewer (``averaging.py``)."""
        return self._lost_reducers.value

    def transfer_s(self) -> float:
        """Seconds spent in all-reduces so far (the link's share of the rounds: comm/link_meter.py)."""
        return self._transfer_us.value / 1e6

    def read(self) -> tuple[int, int, int, int]:
        """(bytes sent, bytes received, values whose reducer failed, rounds in which our own
        reducer refused our contribution: the others did too) so far."""
        return self._sent.value, self._recv.value, self._failed_values.value, self._own_drops.value
