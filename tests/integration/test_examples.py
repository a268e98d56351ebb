"""The scripts in examples/, each run as a user would, in a short form (the tiny model, a few
steps): two sites joining one run, DiLoCo against DDP, a compression sweep from one YAML, a
Hugging Face tiny Llama (with the hf extra), a user's own model and loop on the library."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from diloco.config.launch_env import Launch
from diloco.optional_deps import is_installed
from tests.conftest import TINY, read_records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
SHORT = [setting for setting in TINY if not setting.startswith("comm.")]


def _run_example(script: str, *overrides: str, **env: str) -> str:
    """Run examples/SCRIPT in its own session with this interpreter's diloco; kill what is left."""
    return _run(["bash", str(ROOT / "examples" / script), *overrides], **env)


def _run(command: list[str], **env: str) -> str:
    """Run ``command`` from the repository root in its own session; kill what is left; its output."""
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "DILOCO": f"{sys.executable} -m diloco.cli", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        output = ""
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, output[-4000:]
    return output


def test_two_sites_join_one_run_and_end_with_the_same_params(tmp_path):
    output = _run_example("two_sites.sh", *SHORT, "inner.steps=40", "outer.sync_every=20", RUN_DIR=str(tmp_path))
    assert "run 'diloco': 1 live worker" in output and "joining run 'diloco' as worker 1" in output
    assert re.search(r"step \d+/40  round \d  loss \S+  \d+ tokens/s  ETA \d+:\d\d", output)  # the joiner's progress
    hashes = set()
    for site in ("site-a", "site-b"):
        (records,) = (tmp_path / site).glob("worker-*.jsonl")
        end = next(r for r in map(json.loads, records.read_text().splitlines()) if r["event"] == "end")
        assert end["rounds"] == 2, end
        hashes.add(end["param_sha256"])
    assert len(hashes) == 1


def test_diloco_against_ddp_learns_with_h_times_fewer_bytes_and_writes_the_table_and_plot(tmp_path):
    output = _run_example("diloco_vs_ddp.sh", *SHORT, STEPS="20", OUT=str(tmp_path))
    assert "| m4-h20 |" in output and "| ddp |" in output
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["arms"]["m4-h20"]["traffic_saving"] == pytest.approx(20.0)  # H x fewer rounds, same fp32 payload
    rounds = [r for r in read_records(tmp_path / "m4-h20-seed0", 0) if r["event"] == "round"]
    assert rounds[-1]["val_loss"] < 5.0  # from ln(256) = 5.55 at initialisation
    assert matplotlib.image.imread(tmp_path / "quality.png").shape[0] > 100


def test_a_compression_sweep_from_one_yaml_plots_each_codec(tmp_path):
    output = _run_example("compression_sweep.sh", *SHORT, "inner.steps=20", "outer.sync_every=10",
                          CODECS="none int8", OUT=str(tmp_path))  # fmt: skip
    sent = {}
    for codec in ("none", "int8"):
        summary = json.loads((tmp_path / codec / "summary.json").read_text())
        assert summary["workers"] == 4 and summary["rounds"] == 2, summary
        sent[codec] = summary["bytes_sent"]
    assert 3.5 < sent["none"] / sent["int8"] < 4.0  # 8 bits and a scale per 64 values, against 32
    assert f"wrote {tmp_path / 'sweep.png'}" in output
    assert matplotlib.image.imread(tmp_path / "sweep.png").ndim == 3  # diloco plot wrote a readable PNG


@pytest.mark.skipif(not all(is_installed(m) for m in ("transformers", "tokenizers")), reason="needs the hf extra")
def test_a_hugging_face_tiny_llama_trains_with_a_tokenizer_trained_on_the_spot(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text((ROOT / "README.md").read_text() * 9)  # any text (~330 KB)
    output = _run_example("hf_tiny_llama.sh", "inner.steps=40", "logging.eval_batches=4",
                          OUT=str(tmp_path), TEXT=str(text), VOCAB="300", PYTHON=sys.executable)  # fmt: skip
    assert "tokenizer.json: 300 ids" in output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["rounds"] == 2 and summary["params_agree"], summary
    assert summary["final_val_loss"] < 5.7  # ln(300) = 5.70 for a uniform guess


@pytest.mark.timeout(90)
def test_own_loop_trains_its_mlp_with_the_launchers_settings_over_its_own(tmp_path):
    # as diloco launch would start one worker: its overrides outrank what the script passes to diloco.init()
    launch = Launch(overrides=(f"run.dir={tmp_path}", "inner.steps=20", "outer.sync_every=10", "worker.threads=1"))
    script = [sys.executable, str(ROOT / "examples" / "own_loop.py")]
    output = _run(script, PYTHONPATH=str(ROOT), **launch.to_environment())  # this checkout's diloco
    (end,) = [r for r in read_records(tmp_path, 0) if r["event"] == "end"]
    assert end["inner_steps"] == 20 and end["rounds"] == 2, end
    assert end["val_loss"] < 1.3  # from ln(4) = 1.39, a uniform guess over the 4 arms
    assert f"params sha256 {end['param_sha256']}" in output
    assert "batch_size: 64" in (tmp_path / "config.yaml").read_text()  # the script's own setting, not overridden


@pytest.mark.skipif(not all(is_installed(m) for m in ("transformers", "accelerate")), reason="needs the hf extra")
def test_the_hf_trainer_script_as_two_workers_over_hivemind_ends_on_one_model(tmp_path):
    """examples/hf_trainer.py as its docs start it: diloco launch --workers 2 -- python examples/hf_trainer.py."""
    common = [*SHORT, "comm.hivemind.matchmaking_s=20", "comm.deadline_s=30", "inner.steps=20", "outer.sync_every=10"]
    launch = [sys.executable, "-m", "diloco.cli", "launch", "--workers", "2", "--run-dir", str(tmp_path), *common]
    output = _run([*launch, "--", sys.executable, "examples/hf_trainer.py"], PYTHONPATH=str(ROOT))  # this checkout's
    logs = [(tmp_path / f"worker-{index}.log").read_text() for index in range(2)]
    ends = [next(r for r in read_records(tmp_path, index) if r["event"] == "end") for index in range(2)]
    assert [(end["inner_steps"], end["rounds"]) for end in ends] == [(20, 2), (20, 2)], output[-3000:]
    assert ends[0]["param_sha256"] == ends[1]["param_sha256"]  # one model: the rounds averaged both workers
    assert all(r["peers"] == 2 for index in range(2) for r in read_records(tmp_path, index) if r["event"] == "round")
    assert f"worker 1: 20 steps, 2 rounds, val_loss {ends[1]['val_loss']:.4f}" in logs[1]
    assert "params: identical across 2 workers" in output
    assert (tmp_path / "model" / "config.json").is_file()  # worker 0 saved it
