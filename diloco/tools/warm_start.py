"""Starting ``diloco`` commands on this machine in a fraction of a second: forked from a warm process.

A fresh ``python -m diloco.cli train`` spends 3-4 s of CPU importing PyTorch (its compiler stack
comes with the first optimizer step), hivemind and SciPy before it does anything; a launcher that
starts four workers on two cores waited about 10 s for that. On Linux, ``diloco local`` (and the
test cluster of ``diloco bench faults``) asks a fork server for each worker instead:
multiprocessing's ``forkserver``, one per launcher, started once with those modules imported and
no thread running, forks a child that runs the command's module as ``python -m`` would
(``runpy``). The child is the process the command line would have started, as far as anyone can
see: its own session (the launcher stops its whole tree with ``killpg``), its log as stdout and
stderr, the launcher's working directory and environment, SIGTERM when the launcher dies however
it dies (the server exits with the launcher and the child dies with the server), the command's
exit status and the exit handlers run, and its own of hivemind's process-wide locks
(``own_hivemind_locks``: the server's would be shared by every child).

A launcher that was itself started so (a test's ``diloco local``) holds the server's imports
already: with no other thread running and a torch without CUDA, it forks its children itself
rather than start a server of its own, which would spend those seconds again. A launcher that
forks its workers at once, itself or through a server that is up, forks its bootstrap peer too
(``launcher.start_bootstrap``).

A command for a testbed's network namespace enters it in the child, as ``ip netns exec`` would
(``testbed.enter_namespace``). Other platforms, and any launcher run with ``DILOCO_WARM_START=0``,
start each command as a fresh interpreter: ``launcher.start_child`` picks.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

from diloco.lifetime import die_with_parent, shielded_from_interrupts, stop_all
from diloco.tools.testbed import enter_namespace

# what the server imports once, so that no child does: the command line, a worker's and a helper's
# modules and what they pull in (torch, hivemind, scipy), and PyTorch's compiler stack, which the
# first optimizer step imports
PRELOAD = ["torch", "torch._dynamo", "diloco.cli", "diloco.worker.build", "diloco.tools.helper", __name__]
MODULES = {"diloco.cli"}  # the modules whose ``python -m`` command lines start warm
# ``DILOCO_WARM_START=0`` starts every command as a fresh interpreter instead
AVAILABLE = sys.platform == "linux" and os.environ.get("DILOCO_WARM_START", "1") != "0"
# a child forked from the server first runs its launcher's main module again by name, as
# multiprocessing prepares every child of a ``python -m`` program; the server imported that module
# already, and runpy says so on the launcher's terminal, once a child: nothing is wrong (the server
# imports this module, so that the filter holds there and in every child)
warnings.filterwarnings("ignore", message=r"'diloco\.cli' found in sys\.modules", category=RuntimeWarning)
SESSION_WAIT_S = 10.0  # the most a child takes to be in its own session
EXIT_GRACE_S = 10.0  # at this process's exit: how long a live child has between SIGTERM and SIGKILL


def starts_warm(command: list[str]) -> bool:
    """Whether ``command`` (a whole command line) is a ``python -m diloco.cli ...`` a warm start can run."""
    return AVAILABLE and command[:2] == [sys.executable, "-m"] and len(command) > 2 and command[2] in MODULES


class WarmChild:
    """A forked command, seen as ``subprocess.Popen`` shows a child: ``pid``, ``returncode``,
    ``poll()``, ``wait(timeout)``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]):
        self._process, self.args = process, args
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def prepare() -> None:
    """Start this process's server now, so that its imports overlap the caller's other work (the
    first ``start`` waits for them otherwise). The server exits with this process. A process that
    was itself started warm needs none: it forks its children itself (``context``)."""
    if AVAILABLE and not _forks_itself():
        context()
        _ensure_server()


def context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context whose processes are this process's warm children (Linux only):
    forked from its server, or from itself (``_forks_itself``)."""
    if _forks_itself():
        return multiprocessing.get_context("fork")
    forked = multiprocessing.get_context("forkserver")
    forked.set_forkserver_preload(PRELOAD)
    return forked


def start(command: list[str], log: Path, *, netns: str | None = None, env: dict[str, str] | None = None) -> WarmChild:
    """Run ``command`` (``starts_warm``) in a warm child (``context``), writing to ``log``
    (appended); in the network namespace ``netns`` when given (as ``ip netns exec``); with ``env``
    added to this process's environment.
    Returns once the child is in its own session, as ``Popen(start_new_session=True)`` does."""
    module, args = command[2], command[3:]
    forked = context()
    if forked.get_start_method() == "fork":
        server = os.getpid()
    else:
        _ensure_server()
        server = forkserver._forkserver._forkserver_pid
    environment = (os.getcwd(), {**os.environ, **(env or {})})
    process = forked.Process(
        target=_run, args=(module, args, str(Path(log).absolute()), netns, server, *environment), name=module
    )
    process.start()
    child = WarmChild(process, command)
    _wait_for_its_session(child)
    if not _started:
        atexit.register(_stop_the_live_ones)  # after multiprocessing's own exit handler, so it runs before it
    _started.append(child)
    return child


def _ensure_server() -> None:
    """This process's server (and multiprocessing's resource tracker), started if need be, shielded
    from a Ctrl-C or SIGTERM to the process group: this process stops it, once its children are."""
    with shielded_from_interrupts():
        forkserver.ensure_running()


_started: list[WarmChild] = []
_warm_itself = False  # whether this process is a warm child (``_run``)


def starts_at_once() -> bool:
    """Whether a warm start is at once: this process forks its children itself, or its server has
    forked one (its imports are done)."""
    return _forks_itself() or bool(_started)


def _forks_itself() -> bool:
    """Whether this process forks its warm children itself rather than through a server: it was
    started warm (a launcher a test started so: it holds the server's imports), it runs no other
    thread, and its torch has no CUDA (a CUDA driver that a process initialised, even to ask
    whether there is a GPU, is unusable in its forked children)."""
    torch = sys.modules.get("torch")
    no_cuda = torch is None or not torch.backends.cuda.is_built()
    return _warm_itself and no_cuda and threading.active_count() == 1


def _wait_for_its_session(child: WarmChild) -> None:
    deadline = time.monotonic() + SESSION_WAIT_S
    while child.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(child.pid) == child.pid:
                return
        time.sleep(0.005)  # the child's first steps: setsid, then the parent-death signal


def _stop_the_live_ones() -> None:
    """At this process's exit: what a child started with ``Popen`` would get when its launcher dies
    (SIGTERM), then SIGKILL for its session after ``EXIT_GRACE_S``; multiprocessing would
    otherwise wait for every child to end on its own."""
    stop_all([child for child in _started if child.poll() is None], grace_s=EXIT_GRACE_S)


def _untie_from_the_server() -> None:
    """The server hands each child its "alive" pipe and the resource tracker's: a child that kept
    them would keep both alive after the launcher died, and the server would keep the child alive
    in turn (it dies with the server). Closed here, the server goes with the launcher. These are
    multiprocessing's private names (CPython 3.11): a Python that renamed them fails here, loudly."""
    from multiprocessing import resource_tracker

    for owner, name in ((forkserver._forkserver, "_forkserver_alive_fd"), (resource_tracker._resource_tracker, "_fd")):
        if not hasattr(owner, name):
            raise RuntimeError(f"warm start: this Python's multiprocessing has no {name}; set DILOCO_WARM_START=0")
        descriptor = getattr(owner, name)
        if descriptor is not None:
            os.close(descriptor)
            setattr(owner, name, None)


def own_hivemind_locks() -> None:
    """hivemind makes its process-wide locks (an ``MPFuture``'s, its executor's) once, at import: in
    the server, so every child forked from it would share them, and one child killed while holding
    one would hang every later child (a worker's DHT waiting forever to say it is ready). A child
    calls this first, to make its own, as a process started afresh has (hivemind not imported yet:
    its import makes them)."""
    if "hivemind.utils.mpfuture" not in sys.modules:
        return
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()  # hivemind's own: fresh locks, no backend thread of the server's
    _AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def _run(module: str, args: list[str], log: str, netns: str | None, server: int, cwd: str, environ: dict) -> None:
    """In the forked child: become the command's process, run ``python -m module args`` as the
    interpreter would (``runpy``), end as it would: non-daemon threads joined, then the exit
    handlers, with the command's status."""
    global _warm_itself
    _warm_itself = True
    _started.clear()  # forked from a launcher (``context``): its other children are not ours to stop,
    for handler in logging.root.handlers[:]:  # nor its logging ours: the command sets its own
        logging.root.removeHandler(handler)
    _untie_from_the_server()
    own_hivemind_locks()
    os.setsid()
    die_with_parent(signal.SIGTERM, parent_pid=server)  # the server (it exits with the launcher), or the launcher
    descriptor = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    if netns is not None:
        enter_namespace(netns)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a CUDA context does not survive a fork
        raise RuntimeError("warm start: the server initialised CUDA; set DILOCO_WARM_START=0")
    multiprocessing.set_start_method(None, force=True)  # the platform's own, not the server's, for its children
    sys.argv = [module, *args]
    sys.modules.pop(module, None)  # run as __main__ alone, as python -m runs it (the server imported it)
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, int | None):
            print(done.code, file=sys.stderr)
    except BaseException:  # as the interpreter would: the traceback on stderr, status 1
        traceback.print_exc()
        code = 1
    finally:
        threading._shutdown()  # noqa: SLF001 - the interpreter joins non-daemon threads first
        atexit._run_exitfuncs()  # then runs the exit handlers
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)
