"""Tests for diloco.worker.checkpoint: round trip, atomic writes and pruning, corruption fallback, RNG state,
a whole run stopped and resumed bit-exact, writes from the live tensors, and the earlier format read."""

import hashlib
import io
import json
import logging
import random
import threading
import time

import numpy as np
import pytest
import torch

from diloco.config import load_config
from diloco.tools.launcher import simulate
from diloco.worker.checkpoint import (
    CheckpointWriter,
    capture_rng_state,
    list_checkpoints,
    load_latest_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from diloco.worker.checkpoint_file import HEADER, MAGIC_V1
from tests.allocations import NewTensors


def _state(round_index: int) -> dict:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return {
        "round": round_index,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": {"position": 1234 + round_index, "epoch": 2, "order": [3, 1, 2]},
        "rng": capture_rng_state(),
    }


def test_round_trip_restores_tensors_and_nested_dicts(tmp_path):
    state = _state(3)
    path = save_checkpoint(tmp_path, 1, 3, state)
    assert path == tmp_path / "worker-1" / "round-000003.pt"

    loaded = load_latest_checkpoint(tmp_path, 1)
    assert loaded["round"] == 3
    assert loaded["sampler"] == state["sampler"]
    for key, tensor in state["model"].items():
        assert torch.equal(loaded["model"][key], tensor)
    exp_avg = state["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], exp_avg)
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]


def test_saves_leave_no_temp_files_and_prune_to_keep(tmp_path):
    for round_index in range(5):
        save_checkpoint(tmp_path, 0, round_index, {"round": round_index}, keep=2)
    names = sorted(p.name for p in (tmp_path / "worker-0").iterdir())
    assert names == ["round-000003.pt", "round-000004.pt"]
    assert load_latest_checkpoint(tmp_path, 0)["round"] == 4


def test_workers_have_separate_checkpoints(tmp_path):
    save_checkpoint(tmp_path, 0, 7, {"worker": 0})
    save_checkpoint(tmp_path, 1, 2, {"worker": 1})
    assert load_latest_checkpoint(tmp_path, 0) == {"worker": 0}
    assert load_latest_checkpoint(tmp_path, 1) == {"worker": 1}


def test_leftover_temp_files_are_ignored(tmp_path):
    save_checkpoint(tmp_path, 0, 1, {"round": 1})
    (tmp_path / "worker-0" / ".round-000002.pt.abc123.tmp").write_bytes(b"half written")
    assert [r for r, _ in list_checkpoints(tmp_path, 0)] == [1]
    assert load_latest_checkpoint(tmp_path, 0) == {"round": 1}


def test_rejects_keep_below_one(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 0, 0, {}, keep=0)


@pytest.mark.parametrize("damage", ["truncate", "bit_flip", "bit_flip_header", "empty"])
def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog, damage):
    save_checkpoint(tmp_path, 0, 1, {"round": 1, "w": torch.arange(1000.0)}, keep=3)
    newest = save_checkpoint(tmp_path, 0, 2, {"round": 2, "w": torch.arange(1000.0) + 1}, keep=3)
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "bit_flip":
        data[len(data) // 2] ^= 0x01  # inside the tensor bytes: torch.load alone would not notice
    elif damage == "bit_flip_header":
        data[3] ^= 0x80
    else:
        data = bytearray()
    newest.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="diloco.worker.checkpoint"):
        loaded = load_latest_checkpoint(tmp_path, 0)
    assert loaded["round"] == 1
    assert torch.equal(loaded["w"], torch.arange(1000.0))
    assert "round-000002.pt" in caplog.text


def test_returns_none_without_checkpoints(tmp_path):
    assert load_latest_checkpoint(tmp_path, 0) is None
    assert load_latest_checkpoint(tmp_path / "missing", 3) is None


def test_returns_none_when_every_checkpoint_is_corrupt(tmp_path):
    path = save_checkpoint(tmp_path, 0, 0, {"round": 0})
    path.write_bytes(b"garbage")
    assert load_latest_checkpoint(tmp_path, 0) is None


def _draw() -> tuple:
    return (
        random.random(),
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        torch.randint(0, 100, (4,)).tolist(),
    )


def test_rng_state_survives_a_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    save_checkpoint(tmp_path, 0, 0, {"rng": capture_rng_state()})
    expected = _draw()

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draw() != expected
    restore_rng_state(load_latest_checkpoint(tmp_path, 0)["rng"])
    assert _draw() == expected


def test_a_stopped_run_resumes_bit_exact(tmp_path):
    """Checkpoints hold everything: model, both optimizers, data position, RNG (dropout draws from
    it) and error feedback (top-k leaves a residual). One worker, in this process: a run stopped
    after round 1 and resumed ends on the very params and loss of a run that went straight
    through. (Stopping and resuming real workers over hivemind: tests/integration/test_local_run.py.)"""
    from tests.conftest import TINY

    def run(name: str, *extra: str) -> dict:
        cfg = load_config(
            None,
            [*TINY, "compression.name=topk", "inner.steps=30", "outer.sync_every=10", "model.dropout=0.1"]
            + ["comm.backend=simulator", f"comm.run_id={name}", f"run.dir={tmp_path / name}", *extra],
        )
        return simulate(cfg, workers=1)

    def last_record(name: str) -> dict:
        return json.loads((tmp_path / name / "worker-0.jsonl").read_text().splitlines()[-1])

    straight = run("straight")
    assert run("resumed", "faults.stop_after_round=1")["failed_workers"] == [0]  # stopped, as asked
    resumed = run("resumed")
    want, got = last_record("straight"), last_record("resumed")
    assert straight["failed_workers"] == resumed["failed_workers"] == []
    assert got["event"] == want["event"] == "end"
    assert got["param_sha256"] == want["param_sha256"] and got["val_loss"] == want["val_loss"]


def test_the_writer_writes_a_snapshot_that_later_steps_cannot_change(tmp_path):
    weights = torch.zeros(1000)
    started, release = threading.Event(), threading.Event()

    def held(written: int) -> None:  # the write waits, mid-way, until the test lets it go on
        started.set()
        release.wait(timeout=30)

    writer = CheckpointWriter(tmp_path, 0, on_write=held)
    writer.save(1, {"round": 1, "model": {"w": weights}, "order": [weights, (weights, 3)]})
    assert started.wait(timeout=30)
    weights.add_(1.0)  # training goes on while the write is in progress
    release.set()
    writer.close()
    loaded = load_latest_checkpoint(tmp_path, 0)
    assert torch.equal(loaded["model"]["w"], torch.zeros(1000))
    assert torch.equal(loaded["order"][1][0], torch.zeros(1000)) and loaded["order"][1][1] == 3


def test_the_writer_runs_one_write_at_a_time_and_hands_a_failed_ones_error_to_the_next_save(tmp_path):
    active, most = [0], [0]
    lock = threading.Lock()

    def counted(written: int) -> None:
        with lock:
            most[0] = max(most[0], active[0])

    writer = CheckpointWriter(tmp_path, 0, keep=5, on_write=counted)
    original = writer._write

    def tracked(round_index, state):
        with lock:
            active[0] += 1
        try:
            original(round_index, state)
        finally:
            with lock:
                active[0] -= 1

    writer._write = tracked
    for round_index in range(4):
        writer.save(round_index, {"round": round_index, "t": torch.randn(10_000)})
    writer.close()
    assert most[0] == 1 and [r for r, _ in list_checkpoints(tmp_path, 0)] == [0, 1, 2, 3]
    writer.save(4, {"round": 4, "unpicklable": threading.Lock()})  # fails in its thread
    with pytest.raises(TypeError):
        writer.save(5, {"round": 5})
    assert load_latest_checkpoint(tmp_path, 0)["round"] == 3


def test_a_new_writer_removes_the_temp_file_a_killed_process_left(tmp_path):
    folder = tmp_path / "worker-1"
    folder.mkdir()
    left = folder / ".round-000003.pt.3k6vtae2.tmp"  # as a SIGKILL mid-write leaves it
    left.write_bytes(b"\0" * 100)
    other_worker = tmp_path / "worker-0" / ".round-000003.pt.abcdefgh.tmp"
    other_worker.parent.mkdir()
    other_worker.write_bytes(b"\0")
    CheckpointWriter(tmp_path, 1)
    assert not left.exists() and other_worker.exists()


def test_live_parts_are_written_from_the_tensors_themselves_each_before_what_changes_it(tmp_path):
    model = {"w": torch.zeros(1 << 18)}  # 1 MB each
    outer = {"global": torch.ones(1 << 18), "momentum": torch.full((1 << 18,), 2.0)}
    writer = CheckpointWriter(tmp_path, 0)
    with NewTensors() as new:
        writer.save(1, {"model": model, "outer": outer, "round": 1}, live={"model": "step", "outer": "round"})
    assert new.peak_bytes < (1 << 18)  # nothing copied: not even one of the tensors
    writer.wait_for("step")
    model["w"].add_(5.0)  # the next inner update, once its part is written
    writer.wait_for("round")
    outer["global"].add_(5.0)  # the next outer step
    writer.close()
    loaded = load_latest_checkpoint(tmp_path, 0)
    assert torch.equal(loaded["model"]["w"], torch.zeros(1 << 18))
    assert torch.equal(loaded["outer"]["global"], torch.ones(1 << 18))
    assert torch.equal(loaded["outer"]["momentum"], torch.full((1 << 18,), 2.0))


def test_a_tensor_the_state_holds_twice_is_written_once(tmp_path):
    shared = torch.randn(1 << 18)
    once = save_checkpoint(tmp_path, 0, 1, {"outer": [shared]}).stat().st_size
    twice = save_checkpoint(tmp_path, 0, 2, {"model": {"w": shared}, "outer": [shared]}).stat().st_size
    assert twice - once < 4096
    loaded = load_latest_checkpoint(tmp_path, 0)
    assert torch.equal(loaded["model"]["w"], shared) and torch.equal(loaded["outer"][0], shared)


def test_a_checkpoint_of_the_earlier_format_still_loads(tmp_path):
    state = _state(2)
    payload = io.BytesIO()
    torch.save(state, payload)
    body = payload.getvalue()
    folder = tmp_path / "worker-0"
    folder.mkdir()
    header = HEADER.pack(MAGIC_V1, len(body), hashlib.sha256(body).digest())
    (folder / "round-000002.pt").write_bytes(header + body)
    loaded = load_latest_checkpoint(tmp_path, 0)
    assert loaded["sampler"] == state["sampler"]
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])


def test_a_due_checkpoint_waits_while_the_last_one_cost_training_more_than_its_share(tmp_path):
    slow_disk = threading.Event()

    def slow(written: int) -> None:  # a disk that takes over a second for the first write
        if not slow_disk.is_set():
            slow_disk.set()
            time.sleep(1.2)

    writer = CheckpointWriter(tmp_path, 0, on_write=slow)
    assert writer.worth_taking(0.05)  # nothing taken yet
    writer.save(1, {"model": {"w": torch.zeros(1000)}}, live={"model": "step"})
    assert writer.wait_for("step")  # training held up for the slow write
    assert not writer.worth_taking(0.05)  # it cost about all of the time since
    assert writer.worth_taking(0.0)  # 0: every due checkpoint
    writer.close()


@pytest.mark.timeout(30)
def test_a_write_that_fails_before_it_starts_never_holds_training_up(tmp_path):
    (tmp_path / "not-a-folder").write_text("")
    writer = CheckpointWriter(tmp_path / "not-a-folder", 0)
    writer.save(1, {"model": {"w": torch.zeros(10)}}, live={"model": "step"})
    writer.wait_for("step")  # returns: the failed write released what it held
    with pytest.raises(OSError):
        writer.close()
