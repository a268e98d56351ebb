"""How long a worker waits, at most, for each thing it waits on: every bound in one place.

A worker never waits without a bound. Each blocking wait below ends within its bound; past it
the worker logs one line naming what it waited for and for how long, and goes on (the round
failed: it applies its own pseudo-gradient and takes a peer's state later) or exits with a
one-line error, its checkpoint intact. ``docs/waits.md`` is the user's copy of this table.

=====================================  ==========================================================
wait                                   bound
=====================================  ==========================================================
a round: matchmaking + all-reduce      ``round_limit_s``: 2 x ``comm.deadline_s`` + 10 s (one
                                       deadline to find a group, one for the all-reduce; the
                                       margin is the deadline itself when that is shorter)
an overlapped round's pending average  the same, counted from when the worker waits for it
the averager's tensors, its commands   ``control_limit_s``: ``comm.hivemind.request_timeout_s``
                                       x 3, >= 10 s
one DHT read or write (roster, offers) ``control_limit_s``
the gloo data plane's rendezvous       ``control_limit_s`` (then its all-reduce: ``comm.deadline_s``)
a state download (catch-up, joining)   ``comm.deadline_s``
the end-of-run linger (``finish``)     ``comm.hivemind.matchmaking_s``
a site's collectives (torchrun)        ``site_limit_s``: a round, a state download and 30 s
shutdown of the averagers and the DHT  5 s each, then killed
=====================================  ==========================================================

A phase of the worker that lasts longer than ``phase_bounds`` says gets a warning from the
watchdog (``watchdog.py``), with the thread stacks written beside the worker's log.
"""

from __future__ import annotations

ROUND_MARGIN_S = 10.0  # beyond the two deadlines: decoding, the copy back, a loaded machine's lag


def round_limit_s(deadline_s: float) -> float:
    """The longest a worker waits for one round's average (matchmaking, then the all-reduce)."""
    return 2 * deadline_s + min(ROUND_MARGIN_S, deadline_s)


def control_limit_s(request_timeout_s: float) -> float:
    """The longest a worker waits for one request to its own DHT or averager process."""
    return max(10.0, 3 * request_timeout_s)


def phase_bounds(deadline_s: float, matchmaking_s: float) -> dict[str, float]:
    """How long each phase of a worker (``watchdog.py``) may last before the watchdog warns: an inner
    step, a round (then a state download), a download, a hash of the params, a checkpoint, an evaluation, the end."""
    round_s = round_limit_s(deadline_s) + deadline_s
    return {
        "training": deadline_s,
        "averaging": round_s,
        "matchmaking": round_s,
        "downloading state": deadline_s + ROUND_MARGIN_S,
        "checkpointing": deadline_s,
        "hashing": deadline_s,
        "evaluating": deadline_s,
        "finishing": matchmaking_s + deadline_s,
    }


def site_limit_s(deadline_s: float) -> float:
    """The longest a site's ranks wait in a collective for their slowest rank's round: a round, a
    state download, and margin."""
    return round_limit_s(deadline_s) + deadline_s + 30
