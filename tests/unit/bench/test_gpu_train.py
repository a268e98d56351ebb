"""``diloco bench gpu-train``: its figures from the workers' records, and its parts run on the CPU."""

from __future__ import annotations

import json

import pytest

from diloco.bench.gpu_train import phase_shares, steady_tokens_per_s
from diloco.cli import main


def test_phase_shares_leave_out_the_first_round_and_sum_to_one():
    rounds = [
        {"round": 1, "phases_s": {"training": 1.0, "starting": 99.0}},  # compiling: left out
        {"round": 2, "phases_s": {"training": 8.0, "averaging": 1.0, "evaluating": 1.0}},
        {"round": 3, "phases_s": {"training": 8.0, "averaging": 1.0, "checkpointing": 1.0}},
    ]
    shares = phase_shares(rounds)
    assert shares == {"training": 0.8, "averaging": 0.1, "evaluating": 0.05, "checkpointing": 0.05}
    assert list(shares) == ["training", "averaging", "evaluating", "checkpointing"]  # largest first


def test_phase_shares_of_a_single_round_count_it():
    assert phase_shares([{"round": 1, "phases_s": {"training": 3.0, "averaging": 1.0}}]) == {
        "training": 0.75,
        "averaging": 0.25,
    }


def test_steady_tokens_per_s_is_the_median_after_the_first_round():
    records = [{"event": "step", "step": step, "tokens_per_s": rate} for step, rate in [(10, 1.0), (20, 5.0)]]
    records += [{"event": "round", "round": 1}, {"event": "step", "step": 30, "tokens_per_s": 7.0}]
    records += [{"event": "step", "step": 40, "tokens_per_s": 9.0}]
    assert steady_tokens_per_s(records, sync_every=20) == 8.0
    assert steady_tokens_per_s(records[:2], sync_every=20) is None


def test_unknown_part_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", "gpu-train", "--parts", "alone,nope", "--out", str(tmp_path)]) == 2
    assert "nope not among run, alone, diloco" in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_alone_and_diloco_train_on_the_cpu_and_write_their_figures(tmp_path, capsys):
    assert main(["bench", "gpu-train", "--smoke", "--parts", "alone,diloco", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu-train.json").read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    for part, workers in (("alone", 1), ("diloco", 2)):
        figures = record[part]
        assert figures["exit_code"] == 0 and figures["finished"] == workers and figures["params_identical"]
        assert figures["tokens"] == 20 * 4 * 2 * 64  # steps x batch x M x context: equal tokens
        assert figures["phase_shares"]["training"] > 0 and figures["tokens_per_s_steady"] > 0
    assert record["diloco_over_data_parallel_val_loss"] == pytest.approx(
        record["diloco"]["val_loss"] / record["alone"]["val_loss"], abs=1e-4
    )
