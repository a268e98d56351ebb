"""Child processes die with their parent, however the parent dies.

A worker's hivemind DHT and averagers each run in a process of their own, and the DHT's p2pd in
another below it. When the worker is killed with SIGKILL (the OOM killer's way, the commonest
crash on a volunteer's machine) nothing of it runs to stop them: they would live on, orphaned,
holding its port, its memory and its place on the DHT. On Linux each child asks the kernel, as
it starts, to be signalled when its parent dies (``PR_SET_PDEATHSIG``), so the whole tree goes
with the process at its top. Elsewhere these calls do nothing.
"""

from __future__ import annotations

import asyncio.subprocess
import ctypes
import functools
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def terminate_with_parent() -> None:
    """In a child a launcher starts, before exec: SIGTERM it when the launcher dies, however the
    launcher dies (even kill -9), so that it never outlives the command that started it (Linux only)."""
    die_with_parent(signal.SIGTERM)


def die_with_parent(sig: int = signal.SIGKILL, *, parent_pid: int | None = None) -> None:
    """Called in a child: the kernel sends it ``sig`` when its parent dies. With ``parent_pid`` (the
    parent's pid, taken before the child was started), a parent already gone exits the child now."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # it died before we asked
        os._exit(1)


def asyncio_children_die_with_this_process(sig: int = signal.SIGTERM) -> None:
    """Called in a process: every process it starts from now on through
    ``asyncio.create_subprocess_exec`` (hivemind starts its p2pd so) dies with it."""
    if sys.platform != "linux" or getattr(asyncio.subprocess.create_subprocess_exec, "_dies_with_parent", False):
        return
    start = asyncio.subprocess.create_subprocess_exec
    owner = os.getpid()

    @functools.wraps(start)
    async def create_subprocess_exec(*args, **kwargs):
        if kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = functools.partial(die_with_parent, sig, parent_pid=owner)
        return await start(*args, **kwargs)

    create_subprocess_exec._dies_with_parent = True
    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec
