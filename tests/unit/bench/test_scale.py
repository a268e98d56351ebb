"""``diloco bench scale``'s command line, without processes: the size checks, the round count
check, and that a refused size is a row of the results rather than a crash."""

from __future__ import annotations

import json

from diloco.bench import scale


def test_an_unknown_size_is_one_line_and_exit_code_2(tmp_path, capsys):
    assert scale.run_scale_benchmark(sizes=["baby", "x"], steps=8, sync_every=2, compare_rounds=3, out=tmp_path) == 2
    err = capsys.readouterr().err
    assert err == "bench scale: unknown size 'x': baby, 10m, 85m, 300m, llama-150m\n"
    assert not (tmp_path / "results.json").exists()


def test_llama_150m_without_transformers_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr("diloco.optional_deps.is_installed", lambda module: False)
    message = scale.size_error(["baby", "llama-150m"])
    assert "\n" not in message and message.startswith("bench scale: llama-150m") and "pip install -e .[hf]" in message
    assert scale.size_error(["baby", "10m", "85m", "300m"]) is None


def test_a_kill_restart_size_must_be_one_of_the_sizes(tmp_path, capsys):
    code = scale.run_scale_benchmark(
        sizes=["baby"], steps=8, sync_every=2, compare_rounds=3, out=tmp_path, kill_restart=["300m"]
    )
    assert code == 2
    assert capsys.readouterr().err == "bench scale: --kill-restart 300m: not among --sizes baby; add it there\n"
    assert scale.size_error(["baby", "300m"], ["300m"]) is None


def test_too_few_rounds_to_measure_one_after_the_first(tmp_path, capsys):
    assert scale.run_scale_benchmark(sizes=["baby"], steps=2, sync_every=2, compare_rounds=3, out=tmp_path) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_size_this_machine_cannot_hold_is_a_row_saying_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("diloco.worker.memory.available_host_bytes", lambda: 1 << 20)  # 1 MiB free: nothing fits
    assert scale.run_scale_benchmark(sizes=["baby"], steps=4, sync_every=2, compare_rounds=2, out=tmp_path) == 1
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rows[0]["size"] == "baby" and rows[0]["error"].startswith("refused: the model has ")
    assert "| baby | refused: the model has " in capsys.readouterr().out
