"""What the averager's process logs: an expected failure of a step without its traceback."""

from __future__ import annotations

import logging
import sys

from hivemind.averaging.allreduce import AllreduceException

from diloco.comm.hivemind.averager import drop_expected_step_failures


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
