"""What a user sees around a run: Ctrl-C leaves no process behind, nor does kill -9, wandb offline
writes a real run, a checkpoint write cut by kill -9 leaves the previous checkpoint to resume from."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.lifetime import descendants
from diloco.tools import warm_start
from tests.conftest import TINY
from tests.processes import alive, kill_tree, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _spawn(argv: list[str]) -> subprocess.Popen:
    """``python -m diloco.cli ARGV`` in a session of its own, its output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "diloco.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@contextlib.contextmanager
def _training_launcher(run_dir):
    """A ``diloco local`` run of 2 workers that would train for hours, started once both workers
    have written a step record; every process it spawned is killed afterwards, whatever happened."""
    launcher = _spawn(["local", "--workers", "2", "--run-dir", str(run_dir), *TINY, "inner.steps=100000",
                       "outer.sync_every=20"])  # fmt: skip
    spawned: set[int] = set()
    try:
        wait_for(lambda: all((run_dir / f"worker-{i}.jsonl").exists() for i in range(2)), 120, "workers to train")
        spawned = descendants(launcher.pid)
        assert len(spawned) >= 4  # 2 workers, each with hivemind helpers and a p2pd daemon
        yield launcher, spawned
    finally:
        kill_tree(launcher, spawned)


def test_ctrl_c_on_local_stops_every_worker_and_daemon(tmp_path):
    with _training_launcher(tmp_path / "run") as (launcher, spawned):
        os.killpg(launcher.pid, signal.SIGINT)  # a terminal's Ctrl-C: the launcher's whole group
        output, _ = launcher.communicate(timeout=120)  # generous: CI machines are shared and slow
        assert launcher.returncode == 130, output[-3000:]
        assert "Traceback" not in output and "Warning" not in output, output[-3000:]
        wait_for(lambda: not any(alive(pid) for pid in spawned), 10, "every child to exit")


def test_workers_do_not_outlive_a_killed_launcher(tmp_path):
    with _training_launcher(tmp_path / "run") as (launcher, spawned):
        launcher.kill()  # kill -9: no chance to clean up
        launcher.communicate(timeout=10)
        wait_for(lambda: not any(alive(pid) for pid in spawned), 60, "the orphaned workers to exit")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _started(argv: list[str], marker: str):
    """``python -m diloco.cli ARGV`` in a session of its own, once it has printed ``marker``; its
    process group and every process below it are killed afterwards, whatever happened."""
    process = _spawn(argv)
    seen: set[int] = set()
    try:
        lines = []
        deadline = time.monotonic() + 120
        while not any(marker in line for line in lines):
            line = process.stdout.readline()  # the process prints as it starts; EOF if it died
            if not line or time.monotonic() > deadline:
                pytest.fail(f"diloco {argv[0]} did not print {marker!r}:\n{''.join(lines)[-3000:]}")
            lines.append(line)
        seen = descendants(process.pid)
        yield process, seen
    finally:
        kill_tree(process, seen)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


@pytest.mark.parametrize("command", ["train", "bootstrap"])
def test_a_process_killed_with_sigkill_leaves_no_child_behind_and_its_port_free(tmp_path, command):
    # the OOM killer's way: kill -9 of the main process alone, not of its process group
    port = _free_port()
    if command == "train":
        argv = ["train", *TINY, "inner.steps=100000", f"comm.hivemind.port={port}", f"run.dir={tmp_path}"]
        marker = "is up; join this run with"
    else:
        argv, marker = ["bootstrap", "--host", "127.0.0.1", "--port", str(port)], "bootstrap peer up"
    with _started(argv, marker) as (process, children):
        assert len(children) >= 2, children  # hivemind's DHT process and its p2pd (and averagers)
        process.kill()
        process.wait(timeout=10)
        wait_for(lambda: not any(alive(pid) for pid in children), 20, "every child of the killed process to exit")
    _starts_up(argv, marker, tmp_path / "again.log")  # the same port again: nothing holds it


def _starts_up(argv: list[str], marker: str, log: Path) -> None:
    """``python -m diloco.cli ARGV`` forked from the warm server (seconds of imports saved) prints
    ``marker`` in ``log``; its session is killed afterwards."""
    process = warm_start.start([sys.executable, "-m", "diloco.cli", *argv], log)
    try:
        printed = lambda: log.exists() and marker in log.read_text()  # noqa: E731 - the child opens it
        wait_for(lambda: printed() or process.poll() is not None, 120, f"diloco {argv[0]} to start")
        assert marker in log.read_text(), log.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def test_wandb_offline_run_is_written_into_the_run_directory(tmp_path, diloco_cli):
    run_dir = tmp_path / "run"
    done = diloco_cli(
        "train",
        *TINY,
        "inner.steps=10",
        "outer.sync_every=5",
        "--run-dir",
        str(run_dir),
        "logging.wandb=offline",
        "checkpoint.every_rounds=0",
    )
    assert done.returncode == 0, done.stdout[-3000:]
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert any(path.suffix == ".wandb" and path.stat().st_size > 0 for path in runs[0].iterdir())


def test_port_in_use_is_one_clear_line(tmp_path, diloco_cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = diloco_cli("train", *TINY, "inner.steps=5", f"comm.hivemind.port={port}", f"run.dir={tmp_path}")
    assert done.returncode == 2 and "Traceback" not in done.stdout
    assert f"diloco: error: comm.hivemind.port={port} is already in use" in done.stdout


def test_unreachable_peer_is_one_clear_line(tmp_path, diloco_cli):
    with socket.socket() as closed:  # a port that nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    peer = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWCUrnkWAe24z2tswiyaWgkW98KV6g5XGKv1z2Ht2kzJ6H"
    done = diloco_cli(
        "train",
        *TINY,
        "inner.steps=5",
        "worker.count=2",
        f"comm.hivemind.initial_peers=['{peer}']",
        f"run.dir={tmp_path}",
    )
    assert done.returncode == 2 and "Traceback" not in done.stdout
    assert "diloco: error: could not reach any of comm.hivemind.initial_peers" in done.stdout


_WRITE_THEN_HANG = """
import sys, threading, time
from pathlib import Path
import torch
from diloco.worker.checkpoint import CheckpointWriter

folder, marker = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
state = {"round": 0, "model": {"w": torch.randn(1 << 20)}}

def hang_mid_write(written):
    if writer_round[0] == 1 and written > (1 << 21):  # half of round 1's payload is in the temp file
        marker.touch()
        threading.Event().wait()

writer_round = [0]
writer = CheckpointWriter(folder, 0, on_write=hang_mid_write)
writer.save(0, state)
writer.wait()
writer_round[0] = 1
state["model"]["w"].add_(1.0)
writer.save(1, {"round": 1, "model": state["model"]})
threading.Event().wait()
"""


def test_a_worker_killed_in_the_middle_of_a_checkpoint_write_resumes_from_the_previous_one(tmp_path):
    import torch

    from diloco.worker.checkpoint import list_checkpoints, load_latest_checkpoint

    marker = tmp_path / "writing"
    process = subprocess.Popen([sys.executable, "-c", _WRITE_THEN_HANG, str(tmp_path), str(marker)])
    try:
        wait_for(lambda: marker.exists() or process.poll() is not None, 120, "the second write to begin")
        assert process.poll() is None, "the writer exited before its second write"
        temp = [p for p in (tmp_path / "worker-0").iterdir() if p.name.startswith(".")]
        assert temp and temp[0].stat().st_size > (1 << 21)  # killed with half a file written
        process.kill()
        process.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    assert [r for r, _ in list_checkpoints(tmp_path, 0)] == [0]
    torch.manual_seed(0)
    assert torch.equal(load_latest_checkpoint(tmp_path, 0)["model"]["w"], torch.randn(1 << 20))


@contextlib.contextmanager
def _running(argv: list[str], log: Path, marker: str):
    """A fresh ``python -m diloco.cli ARGV`` in a session of its own, as a terminal starts it (its
    output in ``log``), once it has written ``marker``; its group and every process below it are
    killed afterwards, whatever happened."""
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "diloco.cli", *argv], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    seen: set[int] = set()
    try:
        wait_for(lambda: marker in log.read_text() or process.poll() is not None, 120, f"diloco {argv[0]} to start")
        assert process.poll() is None, log.read_text()[-3000:]
        seen = descendants(process.pid)
        yield process
    finally:
        kill_tree(process, seen | descendants(process.pid))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def _interrupt_group(process: subprocess.Popen, sig: int, log: Path) -> None:
    """``sig`` to ``process``'s whole group, as a terminal's Ctrl-C (or ``timeout``, or systemd) sends
    it: the command ends with exit 130, one line and no traceback, and leaves no process behind."""
    below = descendants(process.pid)
    assert below, "the command started no hivemind process"
    os.killpg(process.pid, sig)
    assert process.wait(timeout=60) == 130, log.read_text()[-3000:]
    output = log.read_text()
    assert "Traceback" not in output and "diloco: interrupted" in output, output[-3000:]
    wait_for(lambda: not any(alive(pid) for pid in below), 20, "every child to exit")


def _address(log: Path, prefix: str) -> str:
    """The first peer address printed after ``prefix`` in ``log``."""
    return log.read_text().split(prefix, 1)[1].split("['", 1)[1].split("'", 1)[0]


def test_ctrl_c_and_sigterm_to_the_group_stop_bootstrap_train_join_and_helper(tmp_path):
    # a terminal's Ctrl-C and systemd's or timeout's SIGTERM reach the whole process group; on the way,
    # a volunteer finds the run full (both of its slots held)
    run = [*TINY, "inner.steps=100000", "outer.sync_every=10", "worker.count=1", "worker.slots=2",
           "comm.hivemind.host=127.0.0.1", f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    logs = {name: tmp_path / f"{name}.log" for name in ("bootstrap", "train", "join", "helper")}
    with _running(["bootstrap", "--host", "127.0.0.1", "--port", "0"], logs["bootstrap"], "peer up") as bootstrap:
        peers = f"comm.hivemind.initial_peers=['{_address(logs['bootstrap'], 'bootstrap peer up')}']"
        with _running(["train", *run, peers], logs["train"], "is up; join this run") as worker:
            address = _address(logs["train"], "join this run with")
            volunteer = [
                "join",
                "--peers",
                address,
                f"run.dir={tmp_path / 'volunteer'}",
                "comm.hivemind.host=127.0.0.1",
            ]
            with _running(volunteer, logs["join"], "is up; join this run") as joined:
                full = subprocess.run([sys.executable, "-m", "diloco.cli", *volunteer], capture_output=True, text=True,
                                      timeout=120)  # fmt: skip
                assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
                assert "diloco: error: run 'diloco' is full: its 2 data shards are all held" in full.stderr
                helper_argv = ["helper", "--peers", address, "comm.hivemind.host=127.0.0.1"]
                with _running(helper_argv, logs["helper"], "reducing for its workers") as helper:
                    _interrupt_group(helper, signal.SIGINT, logs["helper"])
                _interrupt_group(joined, signal.SIGINT, logs["join"])
                assert "worker 1 left the run" in logs["join"].read_text()
                # the volunteer marked itself as leaving: the run's worker saw it go, not time out
                wait_for(lambda: "worker 1 left the run" in logs["train"].read_text(), 30, "worker 0 to see it leave")
            _interrupt_group(worker, signal.SIGTERM, logs["train"])
        _interrupt_group(bootstrap, signal.SIGTERM, logs["bootstrap"])
