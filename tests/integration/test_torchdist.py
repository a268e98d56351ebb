"""torch.distributed as a transport: workers launched by torchrun, as launch/torchrun.sh does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import TINY, read_records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _torchrun(run_dir, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "diloco.cli",
        "train",
        *TINY,
        "comm.backend=torchdist",
        f"run.dir={run_dir}",
        "worker.threads=1",
        *overrides,
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, process.returncode, output, "")


@pytest.mark.parametrize("sync_every", [10, 0])  # DiLoCo, and the data-parallel baseline
def test_torchrun_workers_agree_after_every_round(tmp_path, sync_every):
    done = _torchrun(tmp_path, "inner.steps=20", f"outer.sync_every={sync_every}", "logging.eval_every=10")
    assert done.returncode == 0, done.stdout[-3000:]
    rounds = [[r for r in read_records(tmp_path, w) if r["event"] == "round"] for w in range(2)]
    assert len(rounds[0]) == len(rounds[1]) == 2
    for a, b in zip(*rounds):
        assert a["param_sha256"] == b["param_sha256"] and a["peers"] == 2 and a["bytes_sent"] > 0
    assert rounds[0][-1]["val_loss"] < 5.0
