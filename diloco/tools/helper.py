"""``diloco helper``: run a helper for a live run (``comm/hivemind/helper.py``), a public peer that
reduces parts of every round for the run's workers, so that volunteers who are all behind NAT
average. Like ``diloco join`` it takes the run's config from a live worker unless given one, then
serves until Ctrl-C or until the run's workers are gone, one line a round.
"""

from __future__ import annotations

import time

from diloco.comm.hivemind.peer import first_entries, roster_reader
from diloco.comm.members import nobody_answered
from diloco.compression import build_codec
from diloco.config import Config, load_config
from diloco.errors import UsageError
from diloco.tools.join import run_config_file
from diloco.worker.joining import JoinError, check_same_run


def helper_config(config_path: str | None, overrides: list[str], *, wait_s: float) -> tuple[Config, dict]:
    """The run's config (``config_path``, else the one its live workers publish) with ``overrides``
    on top, and the live workers' roster entries once one says what it averages, within ``wait_s``."""
    cfg = load_config(config_path, overrides)
    if cfg.comm.backend != "hivemind":
        raise UsageError(f"a helper joins a hivemind run: comm.backend must be hivemind, not {cfg.comm.backend}")
    if cfg.comm.hivemind.client_mode == "true":
        raise UsageError("a helper reduces for workers that dial it: comm.hivemind.client_mode=true is refused")
    entries = _announced(cfg, wait_s=wait_s, config=config_path is None)
    if config_path is None:
        with run_config_file(entries, cfg.comm.run_id) as (path, digest):
            cfg = load_config(path, overrides)
        print(f"took the run's config from a live peer (sha256 {digest[:12]})", flush=True)
    check_same_run(cfg, entries)  # a helper reduces by the run's screening rules, as every worker does
    return cfg, entries


def _announced(cfg: Config, *, wait_s: float, config: bool) -> dict:
    """The live workers' entries once one has announced what it averages (and, with ``config``, the
    run's config: a worker announces both once it has started); ``JoinError`` past ``wait_s``."""
    deadline = time.monotonic() + wait_s
    with roster_reader(cfg.comm) as read:
        while True:
            entries = {i: e for i, e in first_entries(read, deadline - time.monotonic()).items() if not e.leaving}
            if any(e.protocol.layout and (e.run.get("config") or not config) for e in entries.values()):
                return entries
            if time.monotonic() > deadline:
                if not entries:
                    raise JoinError(nobody_answered(cfg.comm.run_id, cfg.comm.hivemind.initial_peers, wait_s))
                return entries  # what they announced so far: the caller says what is missing
            time.sleep(1.0)  # a worker starting up announces itself first, its run a moment later


def run_helper(config_path: str | None, overrides: list[str], *, wait_s: float) -> int:
    """Serve as a helper of the run until interrupted or until its workers are gone; the exit code."""
    from diloco.comm.hivemind.helper import Helper

    cfg, entries = helper_config(config_path, overrides, wait_s=wait_s)
    layouts = {entry.protocol.layout for entry in entries.values() if entry.protocol.layout}
    if not layouts:
        raise UsageError(f"the live workers of run {cfg.comm.run_id!r} do not say what they average (an older version)")
    if len(layouts) > 1:
        raise UsageError(f"the live workers of run {cfg.comm.run_id!r} average vectors of {len(layouts)} shapes")
    if len(next(iter(layouts))) != 1:
        raise UsageError("a helper reduces runs that average one vector a round: not outer.overlap=streaming")
    codec = build_codec(cfg.compression)
    if any(candidate.gathers for candidate in codec.candidates):
        raise UsageError(f"a helper cannot reduce compression.name={cfg.compression.name}: every worker takes its mean")
    planned = max((entry.planned for entry in entries.values()), default=0) or cfg.worker.count
    helper = Helper(cfg.comm, shapes=next(iter(layouts))[0], codec=codec, planned=planned)
    try:
        where = ", ".join(helper.addresses)
        print(f"helper of run {cfg.comm.run_id!r} up at {where}: reducing for its workers", flush=True)
        reason = helper.serve(lambda reduced: print(reduced.line(), flush=True))
        print(f"helper stopped: {reason}", flush=True)
    finally:
        helper.shutdown()
    return 0
