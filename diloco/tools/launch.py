"""``diloco launch``: a user's script as N workers of a run on this machine, or as one volunteer.

    diloco launch --workers 4 [--run-dir DIR] [CONFIG] [KEY=VALUE ...] -- python train.py ARGS
    diloco launch --join ADDR [--run-dir DIR] [CONFIG] [KEY=VALUE ...] -- python train.py ARGS

The command after ``--`` runs as given, once per worker, with ``DILOCO_LAUNCH`` added to its
environment (``config/launch_env.py``): the config file, the overrides and each worker's own place
(``worker.index``, ``worker.count``, ``run.dir``, the peers, ``worker.threads``), which the
script's ``diloco.init()`` reads. Everything else is ``diloco local``'s (``launcher.run_local``):
the bootstrap peer, the logs ``RUN_DIR/worker-<i>.log``, the progress view, Ctrl-C, the summary
and the exit code; a worker whose script exits 0 finished, whatever records it kept.

With ``--join`` one process joins the live run those peers belong to, in a free slot
(``join.py``), as ``diloco join`` does, writing to this terminal; with no config file, the run's
own, taken from a live peer, is kept as ``RUN_DIR/run-config.yaml`` for the script to read.
"""

from __future__ import annotations

import subprocess

from diloco.config import ConfigError, load_config
from diloco.errors import UsageError, make_folder
from diloco.lifetime import stop_all
from diloco.tools.join import place_in_run, run_config_file
from diloco.tools.launcher import launch_config, run_local, start_fresh, worker_process

DEFAULT_WORKERS = 2
EXIT_INTERRUPTED = 130
EXAMPLE = "diloco launch --workers 2 configs/tiny.yaml -- python train.py"


def run_launch(
    config_path: str | None,
    overrides: list[str],
    script: list[str],
    *,
    workers: int | None = None,
    run_dir: str | None = None,
    join: bool = False,
) -> int:
    """Run ``script`` as ``workers`` workers (default 2) of a run on this machine, or with ``join``
    (``overrides`` name the live run's peers) as one volunteer; the exit code."""
    if not script:
        raise UsageError(f"diloco launch runs the command after --, which is missing: e.g. `{EXAMPLE}`")
    if join:
        if workers is not None:
            raise UsageError("--join starts one worker in a free slot of a live run: leave --workers out")
        return join_run(config_path, overrides, script, run_dir=run_dir)
    workers = DEFAULT_WORKERS if workers is None else workers
    cfg, overrides = launch_config(config_path, overrides, workers=workers, run_dir=run_dir)
    if cfg.comm.backend != "hivemind":
        raise UsageError(
            f"diloco launch starts processes that meet over hivemind: comm.backend must be hivemind, "
            f"not {cfg.comm.backend}"
        )
    make_folder(cfg.run_dir, "run.dir", ConfigError)  # a place that cannot hold it: refused before any worker starts
    return run_local(cfg, config_path, overrides, workers=workers, script=script)


def join_run(config_path: str | None, overrides: list[str], script: list[str], *, run_dir: str | None = None) -> int:
    """``script`` as one worker joining a live run in a free slot; its exit code (130: interrupted)."""
    if run_dir:
        overrides = [*overrides, f"run.dir={run_dir}"]
    cfg, place = place_in_run(config_path, overrides)
    overrides = [*overrides, *place.overrides]
    if config_path is None:
        config_path = keep_run_config(place.entries, cfg.comm.run_id, overrides)
    command, env = worker_process(config_path, overrides, script, join=True)
    return _run_in_foreground(command, env)


def keep_run_config(entries: dict, run_id: str, overrides: list[str]) -> str:
    """The run's config from a live peer, checked with ``overrides`` and written into the run
    directory they give it (``run-config.yaml``), where it outlives this launcher; its path."""
    with run_config_file(entries, run_id) as (path, digest):
        run_dir = load_config(str(path), overrides).run_dir
        make_folder(run_dir, "run.dir", ConfigError)
        kept = run_dir / "run-config.yaml"
        kept.write_text(path.read_text())
    print(f"took the run's config from a live peer (sha256 {digest[:12]}): {kept}", flush=True)
    return str(kept)


def _run_in_foreground(command: list[str], env: dict[str, str] | None) -> int:
    """``command`` writing to this terminal, in its own session (Ctrl-C reaches this launcher,
    which stops it), dying with the launcher; its exit code, 128 + N when killed by signal N."""
    child: subprocess.Popen = start_fresh(command, None, env=env)
    try:
        code = child.wait()
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the worker ...", flush=True)
        return EXIT_INTERRUPTED
    finally:
        stop_all([child])
    return 128 - code if code < 0 else code
