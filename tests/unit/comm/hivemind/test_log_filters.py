"""What the averager's process logs: an expected failure of a step without its traceback, nor the
result of a step the worker cancelled, nor hivemind's traceback of a refused state request."""

from __future__ import annotations

import logging
import sys

import pytest
from hivemind.averaging.allreduce import AllreduceException
from hivemind.utils.mpfuture import MPFuture

from diloco.comm.hivemind.log_filters import (
    drop_expected_step_failures,
    drop_refused_state_requests,
    drop_result_of_a_cancelled_step,
)
from diloco.comm.hivemind.state_access import StateRefused


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


def test_a_refused_state_request_is_left_to_its_one_line_and_another_handler_failure_keeps_its_traceback():
    assert not drop_refused_state_requests(_record_of(StateRefused("state download refused: no proof")))
    assert drop_refused_state_requests(_record_of(ValueError("a bug in a handler")))
