"""A worker that starts behind a live run: a newcomer (``diloco join``) or a restart from an old
checkpoint. Before its first round it takes the global params, outer-optimizer state and round
of a live peer, and starts on the round the others are in (``catch_up_with_run``).

    diloco join configs/tiny.yaml --peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...
"""

from __future__ import annotations

import logging

from diloco.comm.base import CommBackend, CommError, StateRank
from diloco.comm.roster import nobody_answered
from diloco.config import Config, ConfigError
from diloco.outer import OuterStep

logger = logging.getLogger(__name__)


class JoinError(CommError):
    """``diloco join`` found no live run to join (wrong address, wrong run key, or the run is over)."""


def run_identity(cfg: Config) -> dict:
    """The settings every worker of a run must share, as ``KEY: value``: those that fix the shapes of
    the state a newcomer downloads (the model's; not where its weights sit, nor its dropout)."""
    local = ("hf_weights", "dropout")
    return {f"model.{key}": value for key, value in vars(cfg.model).items() if key not in local}


def check_same_run(cfg: Config, others: dict) -> None:
    """Raise ``ConfigError`` (one line) when a live worker runs the run with other shared settings
    than ``cfg``: each key that differs, with both values."""
    mine = run_identity(cfg)
    for entry in others.values():
        theirs = getattr(entry, "run", None) or {}
        differ = [key for key in mine if key in theirs and theirs[key] != mine[key]]
        if differ:
            listed = ", ".join(f"{key}={mine[key]!r} here, {theirs[key]!r} in the run" for key in differ)
            raise ConfigError(
                f"this worker's config differs from that of run {cfg.comm.run_id!r}: {listed}; "
                f"join with the run's settings (its config.yaml)"
            )


def catch_up_with_run(
    outer: OuterStep,
    backend: CommBackend,
    step: int,
    round_index: int,
    *,
    cfg: Config,
    required: bool,
    align_step: bool,
) -> tuple[int, int]:
    """Before the first round: if live peers are rounds ahead, take a peer's global params and
    outer-optimizer state and start on the round they are in, at their inner step when rounds
    are H steps (``align_step``: a round that has begun is joined with fewer samples, and
    weighted by them). Returns (step, round)."""
    sync_every = cfg.outer.sync_every
    others = {i: e for i, e in backend.live_workers().items() if i != cfg.worker.index and not e.leaving}
    if required and not others:
        raise JoinError(nobody_answered(cfg.comm.run_id, cfg.comm.initial_peers))
    check_same_run(cfg, others)  # before any download: a state of other shapes cannot be loaded
    if not any(e.round > round_index for e in others.values()):
        return step, round_index
    found = backend.fetch_state(
        round_index - 1, better_than=StateRank(1 << 30), timeout_s=cfg.comm.deadline_s, newer=True
    )
    if found is None:
        if required:
            raise JoinError(f"no live worker of run {cfg.comm.run_id!r} served its state within comm.deadline_s")
        logger.warning("worker %d: peers are ahead but none served its state; continuing", cfg.worker.index)
        return step, round_index
    taken_round = found.round
    outer.load_state_dict(found.state)
    round_index = taken_round + 1
    if not align_step:
        logger.warning("worker %d took the state after round %d from a peer", cfg.worker.index, taken_round + 1)
        return step, round_index
    round_start = round_index * sync_every
    if round_start >= cfg.inner.steps:  # the peers are past their last round, not yet gone
        logger.warning(
            "worker %d took the state after round %d from a peer, the run's last: nothing is left to train",
            cfg.worker.index,
            taken_round + 1,
        )
        backend.report_progress(round_index, cfg.inner.steps)
        return cfg.inner.steps, round_index
    in_round = [e.step for e in others.values() if e.round == round_index]
    step = min(max(step, round_start, *in_round), round_start + sync_every - 1, cfg.inner.steps - 1)
    logger.warning(
        "worker %d took the state after round %d from a peer; starts round %d at step %d",
        cfg.worker.index,
        taken_round + 1,
        round_index + 1,
        step,
    )
    backend.report_progress(round_index, step)
    return step, round_index
