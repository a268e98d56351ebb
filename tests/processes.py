"""What the tests that start real processes share: whether a process is alive, a bounded wait on
a condition, and killing a process with everything below it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from diloco.lifetime import descendants


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, timeout_s: float, what: str) -> None:
    """Until ``condition()``; the test fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)  # polling a condition with a deadline, not sleeping as synchronisation


def kill_tree(process: subprocess.Popen, seen: set[int]) -> None:
    """SIGKILL ``process``, the processes ``seen`` below it earlier, and those below it now."""
    for pid in [process.pid, *seen, *descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
