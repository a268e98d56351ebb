"""A user's own model and loop (examples/own_loop.py) as a run of real processes on loopback, started
as a user starts it: ``diloco launch --workers 2``; one worker killed with -9 and restarted with its
very command and environment; a volunteer joining with ``diloco launch --join``. Every worker ends
on the same params."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.lifetime import descendants, signal_tree
from tests.conftest import read_records
from tests.processes import alive, kill_tree, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["--", sys.executable, "examples/own_loop.py"]
# 40 rounds, each paced to 5 s of steps until the test releases the pace (faults.step_delay_until),
# so that the run outlasts a restart and a newcomer's start-up however loaded the machine (up to
# 200 s); a dead worker is taken for gone after 8 heartbeats (8 s); a slot kept free for the volunteer
STEPS = 4000
SETTINGS = [f"inner.steps={STEPS}", "outer.sync_every=100", "worker.slots=3", "worker.threads=1",
            "comm.hivemind.heartbeat_s=1", "comm.hivemind.matchmaking_s=5", "comm.deadline_s=30",
            "faults.step_delay_s=0.05"]  # fmt: skip


def _start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A process in a session of its own, writing to ``log``, importing this checkout's diloco."""
    env = {**(env or os.environ), "PYTHONPATH": str(ROOT)}
    with log.open("ab") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _rounds(run_dir: Path, worker: int, *, after: int = 0) -> int:
    """Worker ``worker``'s rounds so far (from its ``after``-th on) that it averaged with another."""
    path = run_dir / f"worker-{worker}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    rounds = [r for r in records if r["event"] == "round"][after:]
    return sum(r["peers"] >= 2 for r in rounds)


def _worker_process(launcher: subprocess.Popen, index: int) -> int:
    """The pid of the launcher's process running the script as worker ``index``: the top one of
    those with its command and environment (the processes it forks, hivemind's, have them too)."""
    found = set()
    for pid in descendants(launcher.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        launch = next((item for item in environ if item.startswith(b"DILOCO_LAUNCH=")), b"")
        if b"examples/own_loop.py" in argv and f"worker.index={index}".encode() in launch:
            found.add(pid)
    top = [pid for pid in found if _parent(pid) not in found]
    if len(top) != 1:
        pytest.fail(f"no one process of the launcher runs worker {index}: {sorted(found)}")
    return top[0]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _command_of(pid: int) -> tuple[list[str], dict[str, str]]:
    """What a process was started with: its argv and environment."""
    argv = [part.decode() for part in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if part]
    pairs = (item.decode().split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if item)
    return argv, dict(pair for pair in pairs if len(pair) == 2)


def _end(run_dir: Path, worker: int) -> dict:
    return [r for r in read_records(run_dir, worker) if r["event"] == "end"][-1]


def test_own_loop_launched_with_a_worker_killed_and_restarted_and_a_volunteer_ends_on_one_model(tmp_path):
    run_dir, volunteer_dir = tmp_path / "run", tmp_path / "volunteer"
    launcher_log = tmp_path / "launcher.log"
    launch = [sys.executable, "-m", "diloco.cli", "launch", "--workers", "2", "--run-dir", str(run_dir)]
    released = tmp_path / "released"
    launcher = _start([*launch, *SETTINGS, f"faults.step_delay_until={released}", *SCRIPT], launcher_log)
    started: list[subprocess.Popen] = []
    seen: set[int] = set()
    try:
        wait_for(lambda: _rounds(run_dir, 1) >= 2 or launcher.poll() is not None, 180, "worker 1's second round")
        assert launcher.poll() is None, launcher_log.read_text()[-3000:]
        seen = descendants(launcher.pid)
        victim = _worker_process(launcher, 1)
        argv, env = _command_of(victim)
        signal_tree(victim, signal.SIGKILL)  # kill -9: no chance to tell the run
        wait_for(lambda: not alive(victim), 30, "the killed worker to exit")
        # the same command again, as its user reruns it: it resumes from its checkpoint and takes the run's state
        before = len([r for r in read_records(run_dir, 1) if r["event"] == "round"])
        started.append(_start(argv, tmp_path / "restarted.log", env))
        # averaging in the run again before the volunteer looks for a free slot: else slot 1 looks free to it too
        rerun_averaged = lambda: _rounds(run_dir, 1, after=before) >= 1  # noqa: E731
        wait_for(lambda: rerun_averaged() or started[0].poll() is not None, 180, "the rerun to average with worker 0")
        address = next(line.split()[-1] for line in launcher_log.read_text().splitlines() if "bootstrap peer:" in line)
        join = [sys.executable, "-m", "diloco.cli", "launch", "--join", address, "--run-dir", str(volunteer_dir)]
        started.append(_start([*join, *SCRIPT], tmp_path / "volunteer.log"))
        wait_for(lambda: _rounds(volunteer_dir, 2) >= 2 or started[1].poll() is not None, 180, "the volunteer's rounds")
        released.touch()  # the pace is over: the run goes on at full speed to its end
        codes = [process.wait(timeout=240) for process in started]
        launcher.wait(timeout=120)
    finally:
        for process in [launcher, *started]:
            kill_tree(process, seen)
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("restarted", "volunteer")}
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs.values())
    assert "joining run 'diloco' as worker 2" in logs["volunteer"], logs["volunteer"][-3000:]
    resumed = [r for r in read_records(run_dir, 1) if r["event"] == "resume"]
    assert resumed and resumed[-1]["source"] in ("own", "live run"), resumed
    ends = [_end(run_dir, 0), _end(run_dir, 1), _end(volunteer_dir, 2)]
    assert len({end["param_sha256"] for end in ends}) == 1, json.dumps(ends, indent=1)
    assert all(end["inner_steps"] == STEPS for end in ends), ends
    rounds = [r for r in read_records(volunteer_dir, 2) if r["event"] == "round"]
    assert any(r["peers"] == 3 for r in rounds), rounds  # the volunteer averaged with both others
