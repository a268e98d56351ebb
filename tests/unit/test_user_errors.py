"""Mistakes a user can make that no other test covers, each answered by one line on stderr that
names the problem and the fix, exit code 2, no traceback, and nothing of the run overwritten.
(Bad keys and values, a missing data path or config file: test_config.py; a port in use and an
unreachable peer, a full run: test_lifecycle.py; a wrong run key: test_volunteer.py; the testbed without
root: test_testbed.py; a run id nobody answers for: test_status.py; a value of the wrong shape,
a moved key and the checks of one setting: test_config.py.)"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from diloco.cli import main
from diloco.models.config import ModelConfig
from diloco.models.gpt import GPT
from diloco.worker.checkpoint import save_checkpoint
from tests.conftest import TINY

pytestmark = pytest.mark.usefixtures("cli_signal_handlers")  # main() sets its own


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("diloco: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_a_checkpoint_of_another_model_is_refused_and_the_runs_config_kept(tmp_path, capsys):
    other = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))
    save_checkpoint(tmp_path / "checkpoints", 0, 1, {"model": other.state_dict()})
    (tmp_path / "config.yaml").write_text("the run's own config\n")
    assert main(["train", *TINY, "inner.steps=5", f"run.dir={tmp_path}"]) == 2
    line = _one_error_line(capsys)
    assert f"the checkpoint in {tmp_path / 'checkpoints'} is of another model (size mismatch" in line, line
    assert "resume with the run's own config" in line
    assert (tmp_path / "config.yaml").read_text() == "the run's own config\n"


def test_a_plot_without_the_optional_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    (tmp_path / "worker-0.jsonl").write_text(
        '{"event": "round", "round": 1, "step": 5, "val_loss": 2.0, "bytes_sent": 10, "tokens": 100}\n'
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it imports
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "out.png")]) == 2
    assert "pip install 'diloco[plot]'" in _one_error_line(capsys)
    assert not (tmp_path / "out.png").exists()


def test_plotting_a_folder_that_is_no_run_says_so(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nothing"), "--out", str(tmp_path / "p.png")]) == 2
    assert "no worker-*.jsonl records (is it a run directory?)" in _one_error_line(capsys)


@pytest.mark.parametrize("argv", [["status", "--peers", " , "], ["join", "--peers", ","]])
def test_an_empty_peer_list_is_one_line(argv, capsys):
    assert main(argv) == 2
    assert "--peers needs at least one multiaddr" in _one_error_line(capsys)


def test_a_site_outside_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "worker.site=true", "inner.steps=2", f"run.dir={tmp_path}"]) == 2
    assert "worker.site=true runs under torchrun" in _one_error_line(capsys)


@pytest.mark.parametrize("seeds", [["--seeds", "0"], ["--first-seed", "-1"]])
def test_a_benchmark_with_no_seed_to_run_is_one_line(seeds, tmp_path, capsys):
    assert main(["bench", "quality", *seeds, "--out", str(tmp_path / "q")]) == 2
    assert "need at least one seed" in _one_error_line(capsys)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("command", [["train"], ["local", "--workers", "3"]])
def test_a_model_too_big_for_this_machine_is_refused_before_training(command, tmp_path, capsys, monkeypatch):
    import diloco.worker.memory

    monkeypatch.setattr(
        diloco.worker.memory, "available_host_bytes", lambda: 2**29
    )  # 0.5 GiB free, whatever the machine has
    big = ["model.n_layer=8", "model.n_head=8", "model.n_embd=512"]  # 25.4M parameters, 0.1 GiB in fp32
    assert main([command[0], *TINY, *big, f"run.dir={tmp_path}", *command[1:]]) == 2
    line = _one_error_line(capsys)
    workers = "3 workers on this machine need" if "local" in command else "a worker needs"
    assert "the model has 25.4M parameters (0.1 GiB in fp32): " + workers in line, line
    assert "of memory and 0.5 GiB is available; choose a smaller model (model.*)" in line, line
    assert not (tmp_path / "checkpoints").exists() and not list(tmp_path.glob("worker-*.jsonl"))


@pytest.mark.parametrize(
    "argv",
    [
        ["helper", "--peers", "/ip4/127.0.0.1/tcp/9/p2p/x", "--wait", "0"],
        ["helper", "--peers", "/ip4/127.0.0.1/tcp/9/p2p/x", "comm.backend=simulator"],
        ["helper", "--peers", "/ip4/127.0.0.1/tcp/9/p2p/x", "comm.hivemind.client_mode=true"],
        ["local", "--workers", "2", "--helpers", "-1"],
        ["local", "--workers", "2", "--helpers", "1", "comm.backend=simulator"],
    ],
)
def test_a_helper_that_cannot_help_is_refused_in_one_line_before_it_starts(argv, capsys):
    assert main(argv) == 2
    assert "helper" in _one_error_line(capsys)


@pytest.mark.parametrize("command", [["train"], ["local", "--workers", "2"]])
def test_a_run_directory_that_is_a_file_is_refused_before_anything_starts(command, tmp_path, capsys):
    taken = tmp_path / "notes.txt"
    taken.write_text("the user's notes\n")
    where = ["--run-dir", str(taken)] if command[0] == "local" else [f"run.dir={taken}"]
    assert main([*command, *TINY, "inner.steps=5", *where]) == 2
    assert _one_error_line(capsys) == (
        f"diloco: error: run.dir={taken} is a file, not a directory: choose another run.dir (or move the file away)"
    )
    assert taken.read_text() == "the user's notes\n"


def test_a_run_directory_inside_a_file_names_the_file(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("")
    assert main(["train", *TINY, "inner.steps=5", f"run.dir={tmp_path / 'notes.txt' / 'run'}"]) == 2
    assert f"{tmp_path / 'notes.txt'} is a file, not a directory: choose another run.dir" in _one_error_line(capsys)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no directory can be made")
@pytest.mark.parametrize("command", [["train"], ["local", "--workers", "2", "comm.backend=simulator"]])
def test_a_run_directory_that_cannot_be_created_is_one_line(command, capsys):
    assert main([*command, *TINY, "inner.steps=5", "run.dir=/proc/diloco-run"]) == 2
    assert _one_error_line(capsys) == (
        "diloco: error: run.dir=/proc/diloco-run cannot be created (No such file or directory): "
        "point run.dir at a place you can write"
    )


@pytest.mark.parametrize("command", [["train"], ["local", "--workers", "2"]])
def test_a_binary_data_file_is_refused_with_what_was_read(command, tmp_path, capsys):
    data = tmp_path / "model.bin"
    data.write_bytes(random.Random(0).randbytes(100_000))
    assert main([*command, *TINY, "inner.steps=5", f"data.path={data}", f"run.dir={tmp_path / 'run'}"]) == 2
    assert _one_error_line(capsys) == (
        f"diloco: error: data.path={data} does not look like text: 10% of its first 64 KiB are control bytes "
        "such as NUL, which text does not hold (a binary file?); point data.path at a text file"
    )
    assert not list((tmp_path / "run").glob("worker-*.jsonl"))


def test_a_directory_given_as_the_config_is_named_a_directory(tmp_path, capsys):
    assert main(["config", str(tmp_path)]) == 2
    assert _one_error_line(capsys) == (
        f"diloco: error: config file {tmp_path} is a directory, not a YAML config file (such as "
        "configs/tiny.yaml, or a run directory's config.yaml)"
    )


def test_a_list_key_without_brackets_shows_the_list(capsys):
    assert main(["config", "comm.hivemind.initial_peers=/ip4/1.2.3.4/tcp/1/p2p/X"]) == 2
    assert _one_error_line(capsys) == (
        "diloco: error: comm.hivemind.initial_peers must be a list: "
        "comm.hivemind.initial_peers=\"['/ip4/1.2.3.4/tcp/1/p2p/X']\""
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (  # invalid YAML: its line and column
            "inner:\n  lr: 0.1\n  steps: [4, 5\nouter:\n  lr: 0.7\n",
            " is not valid YAML: line 4, column 6: did not find expected ',' or ']' "
            "(while parsing a flow sequence from line 3, column 10)",
        ),
        (  # a moved key: an error naming its new place, as on the command line
            "comm:\n  host: 0.0.0.0\n",
            ": comm.host is now comm.hivemind.host: move it under `comm: hivemind:` in the file",
        ),
    ],
)
def test_a_config_files_mistake_names_the_file_and_where_it_is(tmp_path, capsys, text, problem):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    assert main(["config", str(config)]) == 2
    assert _one_error_line(capsys) == f"diloco: error: config file {config}{problem}"


def test_one_simulated_worker_of_several_is_pointed_at_diloco_local(tmp_path, capsys):
    argv = ["train", *TINY, "inner.steps=5", "comm.backend=simulator", "worker.count=2", f"run.dir={tmp_path}"]
    assert main(argv) == 2
    assert "`diloco local --workers 2` starts them" in _one_error_line(capsys)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("argv", "setting"),
    [
        (["plot", "{run}", "--out", "{file}/curves.png"], "--out={file}/curves.png"),
        (["corpus", "{file}/corpus", "--max-bytes", "1000"], "OUT_DIR={file}/corpus"),
        (
            ["train", *TINY, "inner.steps=5", "data.path={data}", "data.token_cache={file}/cache", "run.dir={run}"],
            "data.token_cache={file}/cache",
        ),
    ],
    ids=["plot", "corpus", "token-cache"],
)
def test_a_folder_to_write_under_a_file_names_the_file(argv, setting, tmp_path, capsys):
    if argv[0] == "plot":
        pytest.importorskip("matplotlib")  # an optional extra
    places = {"file": tmp_path / "notes.txt", "run": tmp_path / "run", "data": tmp_path / "text.txt"}
    places["file"].write_text("the user's notes\n")
    places["data"].write_text("to be or not to be, that is the question\n" * 200)
    (places["run"] / "worker-0.jsonl").parent.mkdir()
    (places["run"] / "worker-0.jsonl").write_text(
        '{"event": "round", "round": 1, "step": 5, "val_loss": 2.0, "bytes_sent": 10, "tokens": 100}\n'
    )
    assert main([word.format(**places) for word in argv]) == 2
    name = setting.split("=")[0]
    assert _one_error_line(capsys) == (
        f"diloco: error: {setting.format(**places)} cannot be created ({places['file']} is a file): "
        f"point {name} at a place you can write"
    )


def test_status_on_a_run_directory_points_at_diloco_summary(tmp_path, capsys):
    assert main(["status", str(tmp_path), "--peers", "/ip4/127.0.0.1/tcp/9/p2p/x"]) == 2
    assert f"`diloco summary {tmp_path}` shows a run directory from its records" in _one_error_line(capsys)
