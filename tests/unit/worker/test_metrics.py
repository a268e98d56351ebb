"""Tests for diloco.worker.metrics: JSONL records, summary.json, param hashes and the wandb loggers."""

import json

import numpy as np
import pytest
import torch

from diloco.config import LoggingConfig
from diloco.worker.metrics import (
    JsonlWriter,
    NullLogger,
    WandbLogger,
    build_wandb_logger,
    format_failures,
    format_summary,
    mark_start,
    summarize_run,
    write_summary,
)
from tests.records import mark_start_of_a_gone_process, write_session


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_lines_are_readable_before_close(tmp_path):
    writer = JsonlWriter(tmp_path, 2)
    writer.log({"event": "step", "step": 1, "loss": torch.tensor(2.5), "lr": np.float32(0.5)})
    assert _lines(tmp_path / "worker-2.jsonl") == [{"event": "step", "step": 1, "loss": 2.5, "lr": 0.5}]
    writer.log({"event": "round", "round": np.int64(1), "peers": [0, 1], "x": torch.tensor([1, 2])})
    assert _lines(tmp_path / "worker-2.jsonl")[1] == {
        "event": "round",
        "round": 1,
        "peers": [0, 1],
        "x": [1, 2],
    }
    writer.close()


def test_jsonl_appends_across_restarts(tmp_path):
    with JsonlWriter(tmp_path, 0) as writer:
        writer.log({"event": "step", "step": 1})
    with JsonlWriter(tmp_path, 0) as writer:
        writer.log({"event": "step", "step": 2})
    assert [r["step"] for r in _lines(tmp_path / "worker-0.jsonl")] == [1, 2]


def _end(worker: int, **overrides) -> dict:
    record = {
        "event": "end", "worker": worker, "inner_steps": 100, "rounds": 5, "tokens": 1000,
        "val_loss": 2.0, "bytes_sent": 100, "bytes_recv": 200, "compute_s": 8.0,
        "comm_wait_s": 1.0, "wall_s": 10.0, "param_sha256": "ab" * 32,
    }  # fmt: skip
    record.update(overrides)
    return record


def _write_worker(run_dir, worker: int, end: dict | None) -> None:
    with JsonlWriter(run_dir, worker) as writer:
        writer.log({"event": "step", "step": 10, "round": 0, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 5.0})
        writer.log({"event": "round", "round": 1, "step": 20, "val_loss": 2.5, "peers": 2})
        if end is not None:
            writer.log(end)


def test_summary_means_sums_and_failed_workers(tmp_path):
    _write_worker(tmp_path, 0, _end(0))
    _write_worker(tmp_path, 1, _end(1, tokens=3000, val_loss=2.5, bytes_sent=301, compute_s=4.0, wall_s=6.0))
    _write_worker(tmp_path, 2, None)  # crashed: no end record
    with (tmp_path / "worker-2.jsonl").open("a") as f:
        f.write('{"event": "st')  # a line cut short by the crash

    summary = summarize_run(tmp_path)
    assert summary["workers"] == 2
    assert summary["failed_workers"] == [2]
    assert summary["inner_steps"] == 100 and summary["rounds"] == 5
    assert summary["tokens"] == 4000
    assert summary["final_val_loss"] == pytest.approx(2.25)
    assert summary["bytes_sent"] == 200  # mean 200.5, whole bytes
    assert summary["bytes_recv"] == 200
    assert summary["compute_s"] == pytest.approx(6.0)
    assert summary["comm_wait_s"] == pytest.approx(1.0)
    assert summary["wall_s"] == pytest.approx(8.0)
    assert summary["compute_utilization"] == pytest.approx(0.75)
    assert summary["param_sha256"] == ["ab" * 32, "ab" * 32]
    assert summary["params_agree"] is True
    assert [r["worker"] for r in summary["per_worker"]] == [0, 1]
    assert "identical across 2 workers" in format_summary(summary)


def test_summary_orders_workers_numerically_and_flags_differing_params(tmp_path):
    for worker in (10, 2):
        _write_worker(tmp_path, worker, _end(worker, param_sha256=f"{worker:064x}"))
    summary = summarize_run(tmp_path)
    assert [r["worker"] for r in summary["per_worker"]] == [2, 10]
    assert summary["params_agree"] is False
    assert "DIFFER" in format_summary(summary)


def test_the_summary_of_a_run_that_ended_split_names_each_model_with_its_workers_and_loss(tmp_path):
    for worker, (digest, loss) in enumerate([("aa", 2.07), ("aa", 2.07), ("bb", 2.01)]):
        _write_worker(tmp_path, worker, _end(worker, param_sha256=digest * 32, val_loss=loss))
    summary = summarize_run(tmp_path)
    assert [(m["workers"], m["val_loss"]) for m in summary["models"]] == [([0, 1], 2.07), ([2], 2.01)]
    text = format_summary(summary)
    params = "params: DIFFER: sha256 aaaaaaaaaaaa on workers 0, 1 (val loss 2.0700); bbbbbbbbbbbb on worker 2"
    assert params + " (val loss 2.0100)" in text


def test_write_summary_writes_json_atomically(tmp_path):
    _write_worker(tmp_path, 0, _end(0))
    summary = write_summary(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", "worker-0.jsonl"]


def test_summary_of_run_where_every_worker_failed(tmp_path):
    _write_worker(tmp_path, 0, None)
    summary = summarize_run(tmp_path)
    assert summary["workers"] == 0 and summary["failed_workers"] == [0]
    assert summary["final_val_loss"] is None and summary["compute_utilization"] is None
    text = format_summary(summary)
    assert "n/a" in text and "failed: [0]" in text


def test_disabled_wandb_gives_null_logger(tmp_path):
    logger = build_wandb_logger(
        LoggingConfig(wandb="disabled"), run_dir=tmp_path, run_name="r", worker_index=0, config_dict={}
    )
    assert isinstance(logger, NullLogger)
    logger.log({"event": "step", "loss": 1.0}, step=1)
    logger.finish()
    assert list(tmp_path.iterdir()) == []


def test_bad_wandb_mode_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"logging\.wandb.*disabled, offline, online"):
        build_wandb_logger(LoggingConfig(wandb="onlin"), run_dir=tmp_path, run_name="r", worker_index=0, config_dict={})


@pytest.mark.slow
def test_offline_wandb_run_writes_files(tmp_path, monkeypatch):
    # Keep wandb's own settings and caches inside the test's folder.
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    run_dir = tmp_path / "runs" / "demo"
    logger = build_wandb_logger(
        LoggingConfig(wandb="offline", project="diloco-test"),
        run_dir=run_dir,
        run_name="demo",
        worker_index=1,
        config_dict={"model": {"layers": 4}, "lr": 1e-3},
    )
    assert isinstance(logger, WandbLogger)
    assert logger.run.name == "demo-worker-1"
    assert logger.run.group == "demo"
    assert logger.run.config["lr"] == 1e-3
    logger.log({"event": "step", "step": 1, "loss": torch.tensor(3.0), "note": "dropped"}, step=1)
    logger.log({"event": "round", "round": 1, "val_loss": 2.5}, step=2)
    logger.finish()
    import wandb

    # run.finish() can return before wandb-core has flushed the .wandb file; teardown waits for it.
    wandb.teardown()

    run_dirs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    files = [p for p in run_dirs[0].rglob("*") if p.is_file()]
    (log_file,) = [p for p in files if p.suffix == ".wandb"]
    data = log_file.read_bytes()  # protobuf records: the metric names appear as plain bytes
    assert b"step/loss" in data and b"round/val_loss" in data
    assert b"step/note" not in data


def test_a_round_record_says_its_outcome_which_workers_were_missing_and_what_a_group_of_two_models_did(tmp_path):
    from diloco.comm.base import Outcome, SyncResult
    from diloco.worker.records import WorkerLog

    log = WorkerLog(
        LoggingConfig(wandb="disabled"),
        run_dir=tmp_path,
        run_name="r",
        worker_index=0,
        total_steps=100,
        tokens_per_step=10,
        config_dict={},
    )
    cut = SyncResult(Outcome.AVERAGED, 2, 2.0, group=2, missing=(2, 3), expected=2)
    fewer = SyncResult(Outcome.AVERAGED, 2, 2.0, group=2, expected=4)  # the others are live, and matched apart
    met = SyncResult(Outcome.SPLIT, 4, 4.0, group=4, sides=(2, 2), expected=4, error="the group held 2 models")
    for number, result in enumerate((cut, fewer, met), start=1):
        log.round(number, 20 * number, result, comm_s=1.0, recovered=False, val_loss=3.0, param_hash="ab" * 32)
    log.close()
    rounds = [r for r in _lines(tmp_path / "worker-0.jsonl") if r["event"] == "round"]
    assert rounds[0]["missing"] == [2, 3] and "expected" not in rounds[0]
    assert rounds[1]["expected"] == 4 and "missing" not in rounds[1]
    assert rounds[2]["sides"] == [2, 2] and "expected" not in rounds[2]
    assert [r["outcome"] for r in rounds] == ["averaged", "averaged", "split"]  # what each round produced
    assert "params" not in log.live  # figures to show: the params are declared apart (Membership.declare_params)


def test_a_rerun_is_summarized_from_its_own_records_and_a_worker_that_wrote_none_failed(tmp_path):
    for worker in (0, 1):
        write_session(tmp_path, worker, val_loss=2.5)  # the run before, finished
    for worker in (0, 1):
        mark_start(tmp_path, worker)  # a launcher starts both again; neither writes a record (a config mistake)
    summary = summarize_run(tmp_path, ended=True)
    assert summary["workers"] == 0 and summary["failed_workers"] == [0, 1], summary
    assert summary["final_val_loss"] is None and summary["per_worker"] == []

    write_session(tmp_path, 0, val_loss=2.25)  # then a rerun in which worker 0 finishes and worker 1 stops early
    write_session(tmp_path, 1, finished=False)
    summary = summarize_run(tmp_path, ended=True, errors={1: "failed (exit code 1): RuntimeError: boom"})
    assert summary["workers"] == 1 and summary["failed_workers"] == [1]
    assert summary["final_val_loss"] == 2.25 and [e["worker"] for e in summary["per_worker"]] == [0]
    assert format_failures(summary) == ["worker 1 failed (exit code 1): RuntimeError: boom"]


def test_a_worker_without_an_end_record_is_running_while_its_process_lives(tmp_path):
    write_session(tmp_path, 0, finished=False)  # written by this process, which is alive
    summary = summarize_run(tmp_path)
    assert summary["running_workers"] == [0] and summary["failed_workers"] == []
    assert summary["progress"] == [
        {"worker": 0, "state": "running", "step": 10, "round": 1, "loss": 3.0, "val_loss": 2.0}
    ]
    assert summarize_run(tmp_path, ended=True)["failed_workers"] == [0]  # its launcher knows it ended

    mark_start_of_a_gone_process(tmp_path, 1)
    summary = summarize_run(tmp_path)
    assert summary["running_workers"] == [0] and summary["failed_workers"] == [1]
    assert format_failures(summary) == ["worker 1 failed: it ended without an end record"]


def test_a_worker_logs_a_step_record_at_its_first_step_then_every_log_every(tmp_path):
    write_session(tmp_path, 0)
    steps = [r["step"] for r in _lines(tmp_path / "worker-0.jsonl") if r["event"] == "step"]
    assert steps == [1, 5, 10]  # progress shows from the first step on


def test_round_records_carry_the_wall_time(tmp_path):
    write_session(tmp_path, 0)
    (step,) = [r for r in _lines(tmp_path / "worker-0.jsonl") if r["event"] == "step" and r["step"] == 10]
    (round_record,) = [r for r in _lines(tmp_path / "worker-0.jsonl") if r["event"] == "round"]
    assert round_record["time_s"] >= step["time_s"] >= 5.0


def test_workers_sharing_a_directory_leave_its_summary_to_the_last_one_to_end(tmp_path):
    write_session(tmp_path, 0)
    write_session(tmp_path, 1, finished=False)  # still running (this process)
    assert write_summary(tmp_path, unless_running=True)["running_workers"] == [1]
    assert not (tmp_path / "summary.json").exists()
    write_session(tmp_path, 1)  # it ends (a rerun's session, here)
    write_summary(tmp_path, unless_running=True)
    assert json.loads((tmp_path / "summary.json").read_text())["workers"] == 2
