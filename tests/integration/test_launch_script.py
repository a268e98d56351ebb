"""``diloco launch`` with a script of the user's, launched exactly as a user would: each worker's
process runs the command after ``--`` as written and reads its place in the run from
``DILOCO_LAUNCH``; Ctrl-C and kill -9 of the launcher leave none of its processes behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from diloco.lifetime import descendants
from tests.processes import alive, kill_tree, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# the user's script: the config its launcher passed it, resolved as diloco.init() resolves it, written
# to OUT/worker-<index>.json with its own arguments; then, given a second argument, it blocks
SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from diloco.config import load_config
    from diloco.config.launch_env import launch_from_environment

    launch = launch_from_environment()
    cfg = load_config(launch.config, list(launch.overrides))
    seen = {"argv": sys.argv[2:], "index": cfg.worker.index, "count": cfg.worker.count, "join": launch.join,
            "run_dir": str(cfg.run_dir), "peers": list(cfg.comm.hivemind.initial_peers),
            "steps": cfg.inner.steps, "sync_every": cfg.outer.sync_every}
    out = Path(sys.argv[1])
    (out / f"worker-{cfg.worker.index}.json").write_text(json.dumps(seen))
    if sys.argv[2:] == ["block"]:
        time.sleep(600)  # the workload: a long training run, stopped by its launcher
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "my_train.py"
    path.write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    return path


def test_each_worker_runs_the_script_as_written_with_its_place_in_the_run(tmp_path, script, diloco_cli):
    config, out, run_dir = tmp_path / "run.yaml", tmp_path / "out", tmp_path / "run"
    config.write_text("outer:\n  sync_every: 3\n")
    done = diloco_cli("launch", "--workers", "2", "--run-dir", str(run_dir), str(config), "inner.steps=7",
                      "--", sys.executable, str(script), str(out), "--epochs", "3", "inner.steps=1")  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:]
    seen = {i: json.loads((out / f"worker-{i}.json").read_text()) for i in range(2)}
    assert sorted(path.name for path in out.iterdir()) == ["worker-0.json", "worker-1.json"]
    for i, worker in seen.items():
        assert worker["argv"] == ["--epochs", "3", "inner.steps=1"]  # the script's own, untouched
        assert (worker["index"], worker["count"], worker["join"]) == (i, 2, False)
        assert (worker["steps"], worker["sync_every"], worker["run_dir"]) == (7, 3, str(run_dir))
        assert len(worker["peers"]) == 1 and worker["peers"][0].startswith("/ip4/127.0.0.1/tcp/")
        assert (run_dir / f"worker-{i}.log").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["workers"], summary["failed_workers"]) == (2, []), summary
    assert "run run: 2 workers finished" in done.stdout


@contextlib.contextmanager
def _blocked_launcher(tmp_path, script):
    """``diloco launch`` of 2 workers whose script blocks, yielded once both wrote their file, with
    every process below it; all of them are killed afterwards, whatever happened."""
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "diloco.cli", "launch", "--run-dir", str(tmp_path / "run"),
         "--", sys.executable, str(script), str(out), "block"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    spawned: set[int] = set()
    try:
        ready = lambda: all((out / f"worker-{i}.json").exists() for i in range(2))  # noqa: E731
        wait_for(lambda: ready() or launcher.poll() is not None, 120, "both scripts to start")
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        spawned = descendants(launcher.pid)
        assert len(spawned) >= 3  # the bootstrap peer (and its p2pd) and the 2 scripts
        yield launcher, spawned
    finally:
        kill_tree(launcher, spawned)
        launcher.communicate(timeout=30)


def test_ctrl_c_on_launch_stops_every_script_and_the_bootstrap_peer(tmp_path, script):
    with _blocked_launcher(tmp_path, script) as (launcher, spawned):
        os.killpg(launcher.pid, signal.SIGINT)  # a terminal's Ctrl-C: the launcher's whole group
        output, _ = launcher.communicate(timeout=120)
        assert launcher.returncode == 130, output[-3000:]
        assert "interrupted: stopping workers" in output and "Traceback" not in output, output[-3000:]
        wait_for(lambda: not any(alive(pid) for pid in spawned), 10, "every child to exit")


def test_scripts_do_not_outlive_a_killed_launcher(tmp_path, script):
    with _blocked_launcher(tmp_path, script) as (launcher, spawned):
        launcher.kill()  # kill -9: no chance to clean up
        launcher.communicate(timeout=10)
        wait_for(lambda: not any(alive(pid) for pid in spawned), 60, "the orphaned scripts to exit")
