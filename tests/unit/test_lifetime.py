"""Children started inside ``shielded_from_interrupts`` ignore a terminal's Ctrl-C and a SIGTERM to
the process group (their owner stops them in order); the owner's own handlers are back after. A
fault injected with ``signal_tree`` reaches a daemon in a process group of its own too."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
import time
from pathlib import Path

from diloco.lifetime import INTERRUPTS, descendants, shielded_from_interrupts, signal_tree


def _report_dispositions(pipe) -> None:
    pipe.send([signal.getsignal(sig) == signal.SIG_IGN for sig in INTERRUPTS])


def _dispositions_of_a_child_forked_now() -> list[bool]:
    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_report_dispositions, args=(send,))
    child.start()
    try:
        return receive.recv()
    finally:
        child.join(timeout=30)


def test_a_child_forked_inside_the_block_ignores_interrupts_and_the_parent_keeps_its_handlers():
    def handler(signum, frame):
        raise KeyboardInterrupt

    saved = {sig: signal.signal(sig, handler) for sig in INTERRUPTS}
    try:
        with shielded_from_interrupts():
            assert _dispositions_of_a_child_forked_now() == [True, True]
        assert all(signal.getsignal(sig) is handler for sig in INTERRUPTS)
        assert _dispositions_of_a_child_forked_now() == [False, False]
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)


_PARENT_OF_A_DAEMON = """
import subprocess, sys
daemon = subprocess.Popen(["sleep", "300"], start_new_session=True)  # a group of its own, as p2pd's
print(daemon.pid, flush=True)
daemon.wait()
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: dead
    except OSError:
        return True


def test_signal_tree_reaches_a_descendant_in_a_process_group_of_its_own():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT_OF_A_DAEMON], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    try:
        daemon = int(parent.stdout.readline())
        assert descendants(parent.pid) == {daemon}
        signal_tree(parent.pid, signal.SIGKILL)
        assert parent.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while not _gone(daemon):  # a killpg of the parent's group alone would leave it running
            assert time.monotonic() < deadline, "the daemon outlived the signal"
            time.sleep(0.05)  # polling its state with a deadline
    finally:
        signal_tree(parent.pid, signal.SIGKILL)
