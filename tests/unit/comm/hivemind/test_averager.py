"""What the averager's process logs: an expected failure of a step without its traceback, nor the
result of a step the worker cancelled; how long a part for a group we do not know waits for us to
register it."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import pytest
from hivemind.averaging.allreduce import AllreduceException
from hivemind.utils.mpfuture import MPFuture

from diloco.comm.hivemind.averager import (
    check_declared_weight,
    drop_expected_step_failures,
    drop_result_of_a_cancelled_step,
    group_registered,
)
from diloco.compression import PayloadError


def _record_of(error: Exception) -> logging.LogRecord:
    try:
        raise error
    except Exception:
        exc_info = sys.exc_info()
    return logging.LogRecord("hivemind.averaging.averager", logging.ERROR, __file__, 1, str(error), (), exc_info)


def test_a_step_that_found_no_group_is_left_to_the_workers_one_line_and_a_bug_keeps_its_traceback():
    assert not drop_expected_step_failures(_record_of(AllreduceException("could not find a group")))
    assert drop_expected_step_failures(_record_of(AssertionError("a bug")))
    plain = logging.LogRecord("hivemind.averaging.averager", logging.ERROR, __file__, 1, "a message", (), None)
    assert drop_expected_step_failures(plain)


def test_the_result_of_a_step_the_worker_cancelled_is_not_logged_and_another_invalid_state_is():
    step = MPFuture()
    step.cancel()  # the worker stopped waiting for the step (GroupRound.await_step)
    with pytest.raises(Exception) as late:
        step.set_result(None)  # what hivemind's task does once the step ends
    assert not drop_result_of_a_cancelled_step(_record_of(late.value))
    done = MPFuture()
    done.set_result(None)
    with pytest.raises(Exception) as twice:
        done.set_result(None)
    assert drop_result_of_a_cancelled_step(_record_of(twice.value))
    assert drop_result_of_a_cancelled_step(_record_of(AssertionError("a bug")))


async def _registered_after(delay_s: float, *, joining: bool, group: bytes = b"ours") -> tuple[bool, float]:
    """Our averager registers ``group`` after ``delay_s`` (hivemind's event set): whether a part
    for the group b"ours", asked with a 0.2 s bound, is taken, and after how long."""
    running: dict = {}
    registered = asyncio.Event()  # cleared: we are matchmaking

    async def register() -> None:
        await asyncio.sleep(delay_s)  # the matchmaking's outcome, scripted
        running[group] = asyncio.get_running_loop().create_future()
        registered.set()

    started = time.monotonic()
    task = asyncio.create_task(register())
    taken = await group_registered(b"ours", running, registered, 0.2, joining=lambda: joining)
    task.cancel()
    return taken, time.monotonic() - started


def test_a_part_for_a_group_we_may_still_register_waits_and_one_we_left_is_refused_at_the_bound():
    assert asyncio.run(_registered_after(0.05, joining=False))[0]  # the leader's answer was late: taken
    # past the bound, still following a leader (its answer on its way): taken once registered
    taken, waited = asyncio.run(_registered_after(0.6, joining=True))
    assert taken and waited >= 0.6
    # past the bound, following nobody (we gave up on that leader): refused at the bound
    taken, waited = asyncio.run(_registered_after(5.0, joining=False))
    assert not taken and 0.2 <= waited < 1.0
    # another group registered: refused as soon as it is
    taken, waited = asyncio.run(_registered_after(0.05, joining=True, group=b"another"))
    assert not taken and waited < 0.2


def test_a_part_that_claims_another_weight_than_its_sender_declared_is_refused():
    declared = {"a": 12.0, "b": 12.0, "silent": float("nan")}
    check_declared_weight(declared, "a", 12.0)  # as declared
    check_declared_weight({}, "a", 1000.0)  # nothing declared to us: nothing to compare with
    for sender, weight in (("b", 1000.0), ("silent", 12.0), ("stranger", 12.0)):
        with pytest.raises(PayloadError, match=f"its parts claim weight {weight:g}, not the"):
            check_declared_weight(declared, sender, weight)
