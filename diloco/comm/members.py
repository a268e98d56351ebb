"""Who is live in a run, as a transport's membership shows it to the worker (``Membership.live_workers``):
each live worker's index, progress, whether it is leaving and the run it runs; and the one-line
error of a worker, ``diloco join`` or ``diloco status`` that found nobody of the run."""

from __future__ import annotations

from dataclasses import dataclass, field

# the version of what workers exchange (their records, the rounds' messages): a worker announces it
# with its run (``LiveWorker.run``), and one of another version is refused before it joins, since
# the two would not read each other's records (a run upgrades all its workers together)
PROTOCOL = 3  # 3: a state request carries a proof of the run key (comm/hivemind/state_access.py)
PROTOCOL_KEY = "diloco.protocol"


@dataclass(frozen=True)
class LiveWorker:
    """A live worker of the run, as its membership record says."""

    index: int  # worker index (its data shard)
    round: int  # rounds completed
    step: int  # inner steps done
    leaving: bool = False  # it said it is leaving: no round waits for it
    run: dict = field(default_factory=dict)  # the settings every worker must share (joining.published_run)


def nobody_answered(run_id: str, peers: list[str], timeout_s: float | None = None) -> str:
    """Why no live worker was found: the one-line error of ``diloco join``, ``diloco status`` and a joining worker."""
    within = f" within {timeout_s:g} s" if timeout_s is not None else ""
    through = ", ".join(peers) or "comm.hivemind.initial_peers"
    return (
        f"no live worker of run {run_id!r} answered through {through}{within}: "
        f"check the address, that the run is still going, its run id (comm.run_id) and its key "
        f"(comm.run_key or $DILOCO_RUN_KEY)"
    )
