"""The host process's thread that answers the averager's part requests: a request it cannot read
(its sender ended while sending it, as at Ctrl-C) and a closed pipe end it quietly, with no
traceback on the way."""

from __future__ import annotations

import multiprocessing as mp
import threading
import weakref

from diloco.comm.hivemind.state_serving import _answer_parts


class _Unreadable:
    """Pickles, but fails to unpickle: as a future whose sender's process has gone."""

    def __reduce__(self):
        return (_fail, ())


def _fail():
    raise EOFError("the sender has gone")


class _Owner:
    def __init__(self) -> None:
        self.asked: list[dict] = []

    def _answer_part_request(self, asked: dict):
        self.asked.append(asked)
        return None


class _Future:
    def set_result(self, value) -> None:
        pass


def test_an_unreadable_request_and_a_closed_pipe_end_the_thread_without_a_traceback(monkeypatch):
    raised: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    ours, theirs = mp.Pipe(duplex=True)
    owner = _Owner()
    thread = threading.Thread(target=_answer_parts, args=(theirs, weakref.ref(owner)), daemon=True)
    thread.start()
    ours.send(_Unreadable())
    ours.send(({"manifest": True}, _Future()))  # read after the unreadable one: the thread still answers
    ours.close()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert raised == []
    assert owner.asked == [{"manifest": True}]
