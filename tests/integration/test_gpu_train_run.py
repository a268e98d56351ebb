"""``diloco bench gpu-train``'s hivemind part on the CPU: real workers, one killed with SIGKILL and
restarted mid-run; every worker ends on the same params, the restarted one from its checkpoint."""

from __future__ import annotations

import json

import pytest

from diloco.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_the_run_with_a_restart_ends_on_identical_params(tmp_path):
    assert main(["bench", "gpu-train", "--smoke", "--parts", "run", "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "gpu-train.json").read_text())["run"]
    assert run["exit_codes"] == {"0": 0, "1": 0}, json.dumps(run)
    assert run["finished"] == 2 and run["params_identical"], json.dumps(run)
    assert 15 <= run["killed_at_step"] < 60, json.dumps(run)  # mid-run, not after the end
    assert run["restarted_worker"]["resumed_from_checkpoint"], json.dumps(run)
    assert {"training", "averaging", "checkpointing"} <= run["phase_shares"].keys(), json.dumps(run)
    assert run["peak_host_gb"][0] > 0, json.dumps(run)
