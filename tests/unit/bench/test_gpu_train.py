"""``diloco bench gpu-train``: its figures from the workers' records, and its parts run on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.bench.gpu_train import SMOKE, first_round_tokens_per_s, phase_shares
from diloco.cli import main

ROOT = Path(__file__).resolve().parents[3]


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


def test_tokens_per_s_is_the_first_rounds_median_less_its_compiling_record():
    rates = [(10, 1.0), (20, 5.0), (30, 7.0), (40, 9.0), (50, 100.0)]  # compiling; round 1 ends at 40
    records = [{"event": "step", "step": step, "tokens_per_s": rate} for step, rate in rates]
    assert first_round_tokens_per_s(records, sync_every=40) == 7.0
    assert first_round_tokens_per_s(records[:1], sync_every=40) is None
    restarted = [records[0], records[1], {"event": "step", "step": 10, "tokens_per_s": 1e9}, *records[2:]]
    assert first_round_tokens_per_s(restarted, sync_every=40) == 5.0  # a second life's records left out


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
        assert figures["phase_shares"]["training"] > 0
    assert record["alone"]["tokens_per_s"] > 0 and record["diloco"]["tokens_per_s"] is None
    assert record["diloco_over_data_parallel_val_loss"] == pytest.approx(
        record["diloco"]["val_loss"] / record["alone"]["val_loss"], abs=1e-4
    )


@pytest.mark.slow
def test_gpu_check_smoke_rehearses_the_bench_step_on_the_cpu(tmp_path):
    env = {**os.environ, "SETUP": "0", "PYTHON": sys.executable, "STEPS": "bench", "OUT_DIR": str(tmp_path)}
    done = subprocess.run(
        ["bash", "launch/gpu_check.sh", "--smoke"], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "== gpu_check: done" in done.stdout and "failed: none" in done.stdout
    assert json.loads((tmp_path / "gpu.json").read_text())["complete"]
    assert (tmp_path / "bench.log").read_text().startswith("gpu bench: cpu")


@pytest.mark.slow
def test_alone_rounds_are_plain_training(tmp_path):
    """``alone``'s outer step (sgd, lr 1, momentum 0) sets the params to the local ones: rounds every
    10 steps end where one round at the very end does, up to fp32 rounding."""
    ends = {}
    for sync_every in (10, 30):
        run_dir = tmp_path / f"h{sync_every}"
        overrides = [*SMOKE.overrides, "inner.steps=30", f"outer.sync_every={sync_every}", "outer.optimizer=sgd"]
        overrides += ["outer.lr=1.0", "outer.momentum=0.0", "checkpoint.every_rounds=0", f"run.dir={run_dir}"]
        assert (
            main(["local", *overrides, "comm.backend=simulator", f"comm.run_id=h{sync_every}", "--workers", "1"]) == 0
        )
        ends[sync_every] = json.loads((run_dir / "summary.json").read_text())["final_val_loss"]
    assert ends[10] == pytest.approx(ends[30], abs=2e-4)
