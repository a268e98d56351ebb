"""A ``diloco`` command forked from the warm server looks like the process its command line starts:
its output in its log, its exit status, its own session, a signal's status when killed."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from diloco.tools import warm_start

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not warm_start.AVAILABLE, reason="the warm start forks (Linux only)"),
]
CLI = [sys.executable, "-m", "diloco.cli"]


def test_only_the_diloco_command_line_starts_warm():
    assert warm_start.starts_warm([*CLI, "train"])
    assert not warm_start.starts_warm([sys.executable, "-m", "diloco.bench.payload_peer"])
    assert not warm_start.starts_warm(["ip", "netns", "exec", "ns", *CLI, "train"])
    assert not warm_start.starts_warm([sys.executable])


def test_a_command_writes_to_its_log_and_exits_with_its_status(tmp_path):
    log = tmp_path / "config.log"
    shown = warm_start.start([*CLI, "config", "model.n_layer=3"], log)
    assert shown.wait(timeout=60) == 0 and shown.returncode == 0
    assert "n_layer: 3" in log.read_text()

    refused = warm_start.start([*CLI, "config", "model.n_layer=x"], tmp_path / "refused.log")
    assert refused.wait(timeout=60) == 2
    lines = (tmp_path / "refused.log").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco: error: model.n_layer"), lines


def test_a_command_runs_in_its_own_session_and_a_kill_is_its_status(tmp_path):
    log = tmp_path / "bootstrap.log"
    # a command that serves until stopped, printing its address once it is up
    child = warm_start.start([*CLI, "bootstrap", "--host", "127.0.0.1", "--port", "0"], log)
    try:
        deadline = time.monotonic() + 60
        while "initial_peers=" not in (log.read_text() if log.exists() else ""):
            assert child.poll() is None and time.monotonic() < deadline, log.read_text() if log.exists() else ""
            time.sleep(0.1)  # polling the log for the line, bounded by the deadline
        assert os.getpgid(child.pid) == child.pid  # a session of its own: stopped with killpg, as a launcher does
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.1)
    finally:
        child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_a_process_that_ends_without_stopping_its_children_takes_them_with_it(tmp_path):
    # as a child started with Popen gets SIGTERM when its launcher dies; multiprocessing alone would
    # wait at the launcher's exit for the child to end by itself (a bootstrap peer never does)
    starter = f"""
import sys
from pathlib import Path
from diloco.tools import warm_start
command = [sys.executable, "-m", "diloco.cli", "bootstrap", "--host", "127.0.0.1", "--port", "0"]
print(warm_start.start(command, Path({str(tmp_path / "bootstrap.log")!r})).pid, flush=True)
"""
    done = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    with pytest.raises(ProcessLookupError):
        os.kill(int(done.stdout.split()[0]), 0)


def test_a_child_killed_while_holding_a_hivemind_lock_leaves_it_free_for_every_other_child():
    from hivemind.utils.mpfuture import MPFuture

    def hold_it_and_die():  # as a worker SIGKILLed while its DHT reports to its parent
        warm_start.own_hivemind_locks()
        MPFuture._update_lock.acquire()
        os.kill(os.getpid(), signal.SIGKILL)

    victim = multiprocessing.get_context("fork").Process(target=hold_it_and_die)
    victim.start()
    victim.join(timeout=30)
    assert victim.exitcode == -signal.SIGKILL
    # the lock the next child would start from (the server's) is free: it held its own
    assert MPFuture._update_lock.acquire(timeout=5)
    MPFuture._update_lock.release()
