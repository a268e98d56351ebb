"""Children started inside ``shielded_from_interrupts`` ignore a terminal's Ctrl-C and a SIGTERM to
the process group (their owner stops them in order); the owner's own handlers are back after."""

from __future__ import annotations

import multiprocessing
import signal

from diloco.lifetime import INTERRUPTS, shielded_from_interrupts


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
