"""A worker that starts behind a live run: a newcomer (``diloco join``) or a restart from an old
checkpoint. Before its first round it checks that it runs the run's settings, takes the global
params, outer-optimizer state and round of a live peer (``Recovery.behind_the_run``,
core/recovery.py), and starts on the round and step the others are in (``catch_up_with_run``).

    diloco join configs/tiny.yaml --peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...
    diloco join --peers /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...     # the run's config from a live peer

Every worker publishes the run's resolved config (``shared_config``: all but what is each
machine's own, ``LOCAL_KEYS``) with its sha256 in its roster record; a volunteer who joins with
no config file takes it from there (``config_from_run``), its own overrides on top.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

from diloco.comm.base import CommError, Membership
from diloco.comm.members import PROTOCOL, PROTOCOL_KEY, LiveWorker, nobody_answered
from diloco.config import Config, ConfigError, to_dict
from diloco.core.recovery import Recovery

logger = logging.getLogger(__name__)


class JoinError(CommError):
    """``diloco join`` found no live run to join (wrong address, wrong run key, or the run is over)."""


# the screening every peer must apply alike, so that every peer keeps and drops the same contributions
SCREENING_KEYS = ("trust", "max_norm_ratio", "clip_to_median", "max_weight_ratio", "min_cosine")


def run_identity(cfg: Config) -> dict:
    """The settings every worker of a run must share, as ``KEY: value``: those that fix the shapes of
    the state a newcomer downloads (the model's; not where its weights sit, nor its dropout), and
    the screening of contributions (``SCREENING_KEYS``: a volunteer with a config file of its own
    must not reduce its share of the parts by other rules than the run's)."""
    local = ("hf_weights", "dropout")
    model = {f"model.{key}": value for key, value in vars(cfg.model).items() if key not in local}
    return {**model, **{f"comm.{key}": getattr(cfg.comm, key) for key in SCREENING_KEYS}}


# what each machine sets for itself: never taken from the run's published config
LOCAL_KEYS = (
    "run.dir",
    "worker.index",
    "worker.threads",
    "worker.device",
    "worker.compile",
    "comm.hivemind.host",
    "comm.hivemind.port",
    "comm.hivemind.announce_host",
    "comm.hivemind.initial_peers",
    "comm.hivemind.client_mode",
    "comm.run_key",  # a secret: never published (each holder passes it itself)
    "comm.hivemind.startup_timeout_s",
)


def shared_config(cfg: Config) -> dict:
    """The run's resolved config without ``LOCAL_KEYS``, as plain containers: what a volunteer
    who joins with only an address runs with."""
    tree = to_dict(cfg)
    for key in LOCAL_KEYS:
        *sections, name = key.split(".")
        section = tree
        for part in sections:
            section = section[part]
        section.pop(name, None)
    return tree


def config_digest(tree: dict) -> str:
    return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()


# the digest of the names and shapes of a worker's model's params: a user's model is in no config
MODEL_KEY = "model.params_sha256"


def model_digest(shapes: dict[str, tuple]) -> str:
    """``MODEL_KEY``'s value for a model of these state-dict keys and shapes (resume.py's ``model_shapes``)."""
    return config_digest({key: list(shape) for key, shape in shapes.items()})[:16]


def published_run(cfg: Config, *, model: str = "") -> dict:
    """What a worker announces of its run (``Membership.announce_run``): the settings every worker
    must share (``run_identity``, and ``model``: its model's ``model_digest``), the shared config
    and its digest."""
    tree = shared_config(cfg)
    identity = {**run_identity(cfg), PROTOCOL_KEY: PROTOCOL, **({MODEL_KEY: model} if model else {})}
    return {**identity, "config": tree, "config_sha256": config_digest(tree)}


def config_from_run(entries: dict[int, LiveWorker], run_id: str) -> dict:
    """The shared config the live workers publish, each copy checked against its digest and all
    of them the same; ``JoinError`` (one line) when none publishes one or they differ."""
    found = {}
    for entry in entries.values():
        run = entry.run
        tree, digest = run.get("config"), run.get("config_sha256")
        if isinstance(tree, dict) and digest == config_digest(tree):
            found[digest] = tree
    if not found:
        raise JoinError(
            f"no live worker of run {run_id!r} publishes its config: join with the run's config file "
            f"(diloco join CONFIG --peers ADDR)"
        )
    if len(found) > 1:
        raise JoinError(
            f"the live workers of run {run_id!r} publish {len(found)} different configs: join with the "
            f"run's config file (diloco join CONFIG --peers ADDR)"
        )
    return next(iter(found.values()))


def check_same_run(cfg: Config, others: dict[int, LiveWorker], *, model: str = "") -> None:
    """Raise ``ConfigError`` (one line) when a live worker runs the run with other shared settings
    than ``cfg``: each key that differs, with both values; or with another model (``model``: this
    worker's ``model_digest``)."""
    mine = run_identity(cfg)
    for entry in others.values():
        theirs = entry.run
        if theirs and theirs.get(PROTOCOL_KEY) != PROTOCOL:  # a worker that announced its run, of another release
            raise ConfigError(
                f"run {cfg.comm.run_id!r} runs another version of diloco's protocol "
                f"({theirs.get(PROTOCOL_KEY, 'an older one')} there, {PROTOCOL} here): "
                f"install the diloco release the run's workers run"
            )
        if model and theirs.get(MODEL_KEY, model) != model:
            raise ConfigError(
                f"this worker's model differs from that of run {cfg.comm.run_id!r} (its params' names or shapes): "
                f"every worker of a run must build the same model"
            )
        differ = [key for key in mine if key in theirs and theirs[key] != mine[key]]
        if differ:
            listed = ", ".join(f"{key}={mine[key]!r} here, {theirs[key]!r} in the run" for key in differ)
            raise ConfigError(
                f"this worker's config differs from that of run {cfg.comm.run_id!r}: {listed}; "
                f"join with the run's settings (its config.yaml)"
            )


@dataclass(frozen=True)
class Joining:
    """How a worker starts its run (``catch_up``): behind live peers, it takes their state first.
    ``required``: a live run must answer (``diloco join``); ``align_step``: rounds are H steps, so
    it starts at their step; ``model``: its ``model_digest``, which theirs must match."""

    recovery: Recovery
    membership: Membership
    cfg: Config
    required: bool
    align_step: bool
    model: str = ""

    def catch_up(self, step: int, round_index: int) -> tuple[int, int]:
        """Where the worker starts: (step, round) (``catch_up_with_run``)."""
        return catch_up_with_run(
            self.recovery,
            self.membership,
            step,
            round_index,
            cfg=self.cfg,
            required=self.required,
            align_step=self.align_step,
            model=self.model,
        )


def catch_up_with_run(
    recovery: Recovery,
    membership: Membership,
    step: int,
    round_index: int,
    *,
    cfg: Config,
    required: bool,
    align_step: bool,
    model: str = "",
) -> tuple[int, int]:
    """Before the first round: if live peers are rounds ahead, take a peer's global params and
    outer-optimizer state and start on the round they are in, at their inner step when rounds
    are H steps (``align_step``: a round that has begun is joined with fewer samples, and
    weighted by them). ``model``: this worker's ``model_digest``. Returns (step, round)."""
    sync_every = cfg.outer.sync_every
    others = {i: e for i, e in membership.live_workers().items() if i != cfg.worker.index and not e.leaving}
    if required and not others:
        raise JoinError(nobody_answered(cfg.comm.run_id, cfg.comm.hivemind.initial_peers))
    check_same_run(cfg, others, model=model)  # before any download: a state of other shapes cannot be loaded
    if not any(e.round > round_index for e in others.values()):
        return step, round_index
    taken_round = recovery.behind_the_run(round_index, timeout_s=cfg.comm.deadline_s)
    if taken_round is None:
        if required:
            raise JoinError(f"no live worker of run {cfg.comm.run_id!r} served its state within comm.deadline_s")
        logger.warning("worker %d: peers are ahead but none served its state; continuing", cfg.worker.index)
        return step, round_index
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
        membership.report_progress(round_index, cfg.inner.steps)
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
    membership.report_progress(round_index, step)
    return step, round_index
