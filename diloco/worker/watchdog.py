"""What a worker is doing now, and a watchdog that says so when it takes too long.

The training loop names each phase as it enters it: ``training`` (one inner step), ``averaging``
(a round; the transport tells ``matchmaking`` from the all-reduce itself), ``downloading state``,
``checkpointing``, ``evaluating``, ``finishing``. The phase and when it began go into the worker's
roster record, so ``diloco status`` shows them. A background thread looks every second: a phase
that has lasted longer than its bound gets one warning line naming it and for how long (again at
twice and four times the bound), and every thread's stack is written to ``stacks-worker-N.txt``
in the run directory, which tells where a stuck worker is stuck.

The watchdog also adds up the seconds spent in each phase: ``take_spent()`` hands over the sums
since it was last called (a round record carries them as ``phases_s``).

Each wait inside a phase has a bound of its own (``comm/bounds.py``) and ends by itself: the
watchdog only makes a slow phase visible, it never interrupts one.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

PHASES = (
    "training",
    "averaging",
    "matchmaking",
    "downloading state",
    "hashing",
    "evaluating",
    "checkpointing",
    "finishing",
)


class Watchdog:
    """The worker's current phase. ``bounds`` gives each phase's bound in seconds (a phase without
    one is never warned about); ``on_phase(name, since)`` is told of every change (``since`` is
    ``time.time()``); ``on_stall(name, seconds)`` is called when a phase outlasts its bound (default:
    a warning, and the thread stacks written to ``stacks_path``)."""

    def __init__(
        self,
        bounds: dict[str, float],
        *,
        stacks_path: Path | None = None,
        on_phase: Callable[[str, float], None] | None = None,
        on_stall: Callable[[str, float], None] | None = None,
        poll_s: float = 1.0,
    ):
        self.bounds, self.stacks_path, self.poll_s = bounds, stacks_path, poll_s
        self._on_phase, self._on_stall = on_phase, on_stall or self._warn
        self._lock = threading.Lock()
        self._phase, self._since, self._started = "starting", time.time(), time.monotonic()
        self._counted_from = self._started  # the current phase's time before it is in _spent
        self._warned = 0  # warnings given for the current phase (at 1, 2 and 4 x its bound)
        self._spent: dict[str, float] = {}  # seconds per phase since take_spent(), the current one excluded
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="diloco-watchdog", daemon=True)
        self._thread.start()

    def enter(self, phase: str) -> None:
        """The worker is now in ``phase`` (entering the same phase again restarts its clock)."""
        now = time.monotonic()
        with self._lock:
            self._spent[self._phase] = self._spent.get(self._phase, 0.0) + now - self._counted_from
            self._phase, self._since, self._started, self._warned = phase, time.time(), now, 0
            self._counted_from = now
            since = self._since
        if self._on_phase is not None:
            self._on_phase(phase, since)

    @contextlib.contextmanager
    def phase(self, name: str, then: str = "training"):
        """In ``name`` for the block, then in ``then``."""
        self.enter(name)
        try:
            yield
        finally:
            self.enter(then)

    def current(self) -> tuple[str, float]:
        """The phase and how many seconds it has lasted."""
        with self._lock:
            return self._phase, time.monotonic() - self._started

    def take_spent(self) -> dict[str, float]:
        """Seconds spent in each phase since the last call (the phase in progress up to now), by name."""
        now = time.monotonic()
        with self._lock:
            spent, self._spent = self._spent, {}
            spent[self._phase] = spent.get(self._phase, 0.0) + now - self._counted_from
            self._counted_from = now  # what is left of the current phase counts towards the next call
        return spent

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.poll_s + 1)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                phase, lasted, warned = self._phase, time.monotonic() - self._started, self._warned
                bound = self.bounds.get(phase)
                due = bound is not None and warned < 3 and lasted > bound * (1 << warned)
                if due:
                    self._warned += 1
            if due:
                self._on_stall(phase, lasted)

    def _warn(self, phase: str, lasted: float) -> None:
        where = ""
        if self.stacks_path is not None:
            try:
                self.stacks_path.write_text(thread_stacks())
                where = f"; thread stacks in {self.stacks_path}"
            except OSError:
                pass
        logger.warning("still %s after %.0f s (its bound: %.0f s)%s", phase, lasted, self.bounds[phase], where)


def thread_stacks() -> str:
    """Every thread's stack, as a traceback prints it."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        blocks.append(f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(blocks)
