"""``diloco launch``: what each worker's process is given (the user's command as written, the
launcher's config and overrides with its place in the run, through ``DILOCO_LAUNCH``), how the
command line splits at ``--``, and the mistakes refused in one line before anything starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from diloco.cli import _parse, main
from diloco.config import load_config
from diloco.config.launch_env import Launch, launch_from_environment
from diloco.tools.launcher import worker_overrides, worker_process

pytestmark = pytest.mark.usefixtures("cli_signal_handlers")  # main() sets its own

PEER = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWExample"


def _place(index: int, run_dir: Path) -> list[str]:
    return worker_overrides(["inner.lr=0.01"], index, 3, run_dir, [PEER], 2)


def test_a_script_runs_as_written_and_reads_its_place_in_the_run_from_the_environment(tmp_path):
    script = ["python", "my_train.py", "--epochs", "3", "inner.lr=9"]
    command, env = worker_process("configs/tiny.yaml", _place(1, tmp_path), script)
    assert command == script and command is not script
    launch = launch_from_environment(env)
    assert launch == Launch("configs/tiny.yaml", tuple(_place(1, tmp_path)), join=False)
    assert launch.overrides[:2] == ("inner.lr=0.01", "worker.index=1")  # the launcher's first, then its place

    cfg = load_config(None, list(launch.overrides))  # what diloco.init() makes of it
    assert (cfg.worker.index, cfg.worker.count, cfg.worker.threads) == (1, 3, 2)
    assert cfg.run_dir == tmp_path and list(cfg.comm.hivemind.initial_peers) == [PEER]
    assert cfg.inner.lr == 0.01


def test_a_volunteers_script_is_told_to_join_a_live_run(tmp_path):
    _, env = worker_process(None, ["comm.hivemind.initial_peers=['x']"], ["python", "t.py"], join=True)
    assert launch_from_environment(env) == Launch(None, ("comm.hivemind.initial_peers=['x']",), join=True)


def test_diloco_local_still_starts_diloco_train_with_the_same_overrides(tmp_path):
    command, env = worker_process("configs/tiny.yaml", _place(0, tmp_path))
    assert env is None
    assert command == [sys.executable, "-m", "diloco.cli", "train", "configs/tiny.yaml", *_place(0, tmp_path)]
    command, _ = worker_process(None, ["a=1"])
    assert command == [sys.executable, "-m", "diloco.cli", "train", "a=1"]


def test_the_words_after_the_double_dash_are_the_command_untouched():
    args = _parse(["launch", "--workers", "3", "cfg.yaml", "--run-dir", "r", "inner.lr=1", "--",
                   "python", "t.py", "--workers", "9", "-v", "x=1", "--"])  # fmt: skip
    assert args.script == ["python", "t.py", "--workers", "9", "-v", "x=1", "--"]
    assert (args.workers, args.run_dir, args.config, args.overrides) == (3, "r", "cfg.yaml", ["inner.lr=1"])
    assert _parse(["-v", "launch", "--", "python", "t.py"]).script == ["python", "t.py"]
    assert _parse(["launch", "--join", "/ip4/a", "--", "./t"]).join == "/ip4/a"


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("diloco: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["launch", "--workers", "2"], "runs the command after --, which is missing"),
        (["launch", "--"], "runs the command after --, which is missing"),
        (["launch", "inner.nope=1", "--", "python", "t.py"], "inner.nope"),
        (["launch", "--workers", "0", "--", "python", "t.py"], "--workers=0 must be at least 1"),
        (["launch", "comm.backend=simulator", "--", "python", "t.py"], "comm.backend must be hivemind"),
        (["launch", "--join", "/ip4/a", "--workers", "2", "--", "python", "t.py"], "leave --workers out"),
        (["launch", "--join", " , ", "--", "python", "t.py"], "--join needs at least one multiaddr"),
    ],
)
def test_a_launch_mistake_is_one_line_before_anything_starts(argv, problem, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([*argv[:1], "--run-dir", str(run_dir), *argv[1:]]) == 2
    assert problem in _one_error_line(capsys)
    assert not run_dir.exists()  # no bootstrap peer, no worker, no directory
