"""What the averager's process leaves out of its log: hivemind's tracebacks of the failures the
worker reports in one line itself, and of the state requests it refused (``state_access.py``
logs each refusal in one line); installed by ``ExactAverager.run``."""

from __future__ import annotations

import concurrent.futures
import logging

from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.matchmaking import MatchmakingException

from diloco.comm.hivemind.state_access import StateRefused


def drop_expected_step_failures(record: logging.LogRecord) -> bool:
    """A logging filter for hivemind's averager: it logs a failed step's exception with its
    traceback, then hands the exception to the step's caller, and the worker reports the round's
    failure in one line with the exception's message (core/outer.py). hivemind's record of an
    expected failure (no group found, a group that broke up) is left out; any other stays."""
    return not (record.exc_info and isinstance(record.exc_info[1], (AllreduceException, MatchmakingException)))


def drop_result_of_a_cancelled_step(record: logging.LogRecord) -> bool:
    """A logging filter for asyncio in the averager's process: a step the worker stopped waiting
    for (``GroupRound.await_step`` cancels it) may still end inside hivemind, whose task then fails
    to set the cancelled step's result, and asyncio logs that with a traceback. The worker has
    reported the round already; any other record stays."""
    error = record.exc_info[1] if record.exc_info else None
    return not (isinstance(error, concurrent.futures.InvalidStateError) and "CANCELLED" in str(error))


def drop_refused_state_requests(record: logging.LogRecord) -> bool:
    """A logging filter for hivemind's p2p daemon: a handler that raised is logged with its
    traceback (and its message goes to the caller); a refused state request is logged in one
    line already (``StateAccess.check``). Any other record stays."""
    return not (record.exc_info and isinstance(record.exc_info[1], StateRefused))


def install() -> None:
    """Add the filters where they apply (in the averager's process)."""
    logging.getLogger("hivemind.averaging.averager").addFilter(drop_expected_step_failures)
    logging.getLogger("asyncio").addFilter(drop_result_of_a_cancelled_step)
    logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(drop_refused_state_requests)
