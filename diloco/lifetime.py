"""Child processes die with their parent, however the parent dies.

A worker's hivemind DHT and averagers each run in a process of their own, and the DHT's p2pd in
another below it. When the worker is killed with SIGKILL (the OOM killer's way, the commonest
crash on a volunteer's machine) nothing of it runs to stop them: they would live on, orphaned,
holding its port, its memory and its place on the DHT. On Linux each child asks the kernel, as
it starts, to be signalled when its parent dies (``PR_SET_PDEATHSIG``), so the whole tree goes
with the process at its top. Elsewhere these calls do nothing.

A launcher that stops its children on purpose does it with ``stop_all``: SIGTERM (a worker shuts
its peers down), a grace period, then SIGKILL for each child's whole session.

A terminal's Ctrl-C, and a SIGTERM to a whole process group (what ``timeout``, Slurm and systemd
send), reach every process of the group at once. Only the process at the top acts on them: it
marks the worker as leaving through its DHT peer and then stops its children in order. So the
children it starts are shielded (``shielded_from_interrupts``): hivemind's processes ignore both
signals, and p2pd runs in a process group of its own; each still dies with its parent. A worker
that is a user's script (``diloco.DiLoCo``) takes SIGTERM as Ctrl-C inside its block
(``sigterm_as_interrupt``). A fault
injected on purpose (a benchmark's SIGSTOP or SIGKILL of a worker) goes to the whole tree
(``signal_tree``), p2pd's group included.
"""

from __future__ import annotations

import asyncio.subprocess
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

_PR_SET_PDEATHSIG = 1
INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 10.0  # how long a worker gets to shut its peers down after being asked to stop


class Stoppable(Protocol):
    """A child as ``subprocess.Popen`` shows it (a forked one too: ``warm_start.WarmChild``),
    started in a session of its own."""

    pid: int

    def poll(self) -> int | None: ...

    def send_signal(self, signum: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def stop_all(children: Sequence[Stoppable], grace_s: float = GRACE_S) -> None:
    """SIGTERM each child (a worker shuts its peers down), then, after ``grace_s``, SIGKILL whatever
    is left of its session (a worker's session holds its hivemind helpers and p2pd daemons too)."""
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
    for child in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux: read from /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def signal_tree(pid: int, signum: int) -> None:
    """``signum`` to the process group ``pid`` leads and to every process below it, p2pd (in a group
    of its own) included: a fault injected into a worker (SIGSTOP, SIGKILL) reaches all of it."""
    below = descendants(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
    for child in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signum)


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


@contextlib.contextmanager
def shielded_from_interrupts():
    """Processes forked inside this block ignore SIGINT and SIGTERM (they inherit the disposition):
    the process that starts them stops them in order when it is interrupted, and they die with it.
    This process's own handlers are back as the block ends. A no-op outside the main thread, which
    alone may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in INTERRUPTS}
    try:
        for sig in INTERRUPTS:
            signal.signal(sig, signal.SIG_IGN)
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def raise_keyboard_interrupt(signum, frame) -> None:
    """A signal handler: the signal (SIGTERM) arrives as Ctrl-C does, so the same cleanup runs."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside this block SIGTERM raises ``KeyboardInterrupt`` (a launcher stopping its workers,
    ``kill``), where Python's default handler is in place, on the main thread; the default is back
    as the block ends. A process that set a handler of its own keeps it."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _own_group_dying_with_parent(sig: int, owner: int) -> None:
    """In a daemon's child before exec: a process group of its own (a signal to its parent's group,
    a terminal's Ctrl-C, does not reach it), and ``sig`` when its parent dies."""
    os.setpgid(0, 0)
    die_with_parent(sig, parent_pid=owner)


def asyncio_children_die_with_this_process(sig: int = signal.SIGTERM) -> None:
    """Called in a process: every process it starts from now on through
    ``asyncio.create_subprocess_exec`` (hivemind starts its p2pd so) dies with it, in a process
    group of its own (``shielded_from_interrupts``: Go's runtime would not keep an ignored SIGTERM)."""
    if sys.platform != "linux" or getattr(asyncio.subprocess.create_subprocess_exec, "_dies_with_parent", False):
        return
    start = asyncio.subprocess.create_subprocess_exec
    owner = os.getpid()

    @functools.wraps(start)
    async def create_subprocess_exec(*args, **kwargs):
        if kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = functools.partial(_own_group_dying_with_parent, sig, owner)
        return await start(*args, **kwargs)

    create_subprocess_exec._dies_with_parent = True
    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec
