"""Tests for diloco.worker.resume: which state a worker resumes from when its own newest checkpoint
is damaged (real files written by save_checkpoint, one truncated), how that is told, and a whole
simulated run that resumes after the damage on one model."""

from __future__ import annotations

import json

import torch

from diloco.config import load_config
from diloco.tools.launcher import simulate
from diloco.worker.checkpoint import checkpoint_folder, save_checkpoint
from diloco.worker.resume import choose_resume, model_shapes, told
from tests.conftest import TINY

MODEL = torch.nn.Linear(4, 3)
SHAPES = model_shapes(MODEL)
TINY_SIM = [*TINY, "comm.backend=simulator", "outer.sync_every=5", "compression.name=topk"]


def _save(directory, worker: int, round_index: int, *, model=MODEL, keep: int = 3) -> None:
    state = {
        "model": model.state_dict(),
        "inner_optimizer": {"worker": worker},
        "outer": {"round": round_index},
        "error_feedback": {"residuals": [torch.full((3,), float(worker))]},
        "overlap": None,
        "sampler": {"batches_drawn": 10 * round_index + worker, "shard_index": worker},
        "rng": {"worker": worker},
        "step": 5 * round_index,
        "round": round_index,
        "totals": {"bytes_sent": 100 * round_index},
    }
    save_checkpoint(directory, worker, round_index, state, keep=keep)


def _truncate(directory, worker: int, round_index: int) -> None:
    path = checkpoint_folder(directory, worker) / f"round-{round_index:06d}.pt"
    path.write_bytes(path.read_bytes()[:1000])


def test_a_whole_newest_checkpoint_is_resumed_as_the_workers_own(tmp_path):
    for worker in (0, 1):
        _save(tmp_path, worker, 2)
    _save(tmp_path, 1, 4)  # another worker further on does not matter while its own files are whole
    resume = choose_resume(tmp_path, 0, model_shapes=SHAPES)
    assert (resume.source, resume.state["round"], resume.damaged) == ("own", 2, {})
    assert resume.state["rng"] == {"worker": 0}
    # the words diloco's tests and benchmarks look for in a restarted worker's log: "resumed at step"
    record, line = told(resume, 0, step=10, round_index=2, caught_up=False)
    assert line == "worker 0 resumed at step 10, after round 2, from its checkpoint round-000002.pt"
    assert (record["source"], record["damaged"], record["checkpoint"]) == ("own", [], "worker-0/round-000002.pt")
    record, line = told(resume, 0, step=20, round_index=4, caught_up=True)  # its peers were rounds ahead
    assert line.endswith("round-000002.pt, then took the live run's state after round 4 (step 20)")
    assert (record["source"], record["round"], record["step"]) == ("live run", 4, 20)


def test_a_damaged_newest_takes_another_workers_checkpoint_of_a_newer_round_over_its_own_older(tmp_path):
    for worker in (0, 1):
        _save(tmp_path, worker, 2)
        _save(tmp_path, worker, 4)
    _truncate(tmp_path, 0, 4)

    resume = choose_resume(tmp_path, 0, model_shapes=SHAPES)
    assert resume.source == "worker 1" and resume.path.name == "round-000004.pt"
    assert [path.name for path in resume.damaged] == ["round-000004.pt"]
    state = resume.state
    assert (state["round"], state["step"], state["totals"]) == (4, 20, {"bytes_sent": 400})
    assert state["outer"] == {"round": 4} and state["inner_optimizer"] == {"worker": 1}
    # what is each worker's own is not taken: its residual, its RNG; the user's parts (the data
    # position) come along to be read, not loaded (diloco train rebuilds its position from it)
    assert state["error_feedback"] == {} and "rng" not in state
    assert state["sampler"]["batches_drawn"] == 41


def test_a_damaged_newest_falls_back_to_its_own_older_when_no_other_worker_is_further(tmp_path):
    for worker in (0, 1):
        _save(tmp_path, worker, 2)
    _save(tmp_path, 0, 4)
    _truncate(tmp_path, 0, 4)
    resume = choose_resume(tmp_path, 0, model_shapes=SHAPES)
    assert (resume.source, resume.state["round"]) == ("own_older", 2)
    assert resume.state["rng"] == {"worker": 0} and resume.state["sampler"]["shard_index"] == 0


def test_another_workers_damaged_newest_is_passed_over_for_its_older_one(tmp_path):
    _save(tmp_path, 0, 4)
    _truncate(tmp_path, 0, 4)
    for worker in (1, 2):
        _save(tmp_path, worker, 2)
        _save(tmp_path, worker, 4)
    _truncate(tmp_path, 1, 4)
    resume = choose_resume(tmp_path, 0, model_shapes=SHAPES)
    assert (resume.source, resume.state["round"]) == ("worker 2", 4)  # worker 1's round 4 is damaged
    assert [path.name for path in resume.damaged] == ["round-000004.pt"]  # its own only


def test_another_workers_checkpoint_of_another_model_or_for_a_site_rank_is_not_taken(tmp_path):
    _save(tmp_path, 0, 4)
    _truncate(tmp_path, 0, 4)
    _save(tmp_path, 1, 4, model=torch.nn.Linear(4, 5))
    assert choose_resume(tmp_path, 0, model_shapes=SHAPES).source == "fresh"
    _save(tmp_path, 2, 4)
    assert choose_resume(tmp_path, 0, model_shapes=SHAPES).source == "worker 2"
    assert choose_resume(tmp_path, 0, model_shapes=None).source == "fresh"  # a site's rank: its own only


def test_told_says_in_one_line_what_was_damaged_and_where_the_state_came_from(tmp_path):
    for worker in (0, 1):
        _save(tmp_path, worker, 4)
    _truncate(tmp_path, 0, 4)
    resume = choose_resume(tmp_path, 0, model_shapes=SHAPES)
    record, line = told(resume, 0, step=20, round_index=4, caught_up=False)
    assert record == {
        "source": "worker 1",
        "round": 4,
        "step": 20,
        "damaged": ["worker-0/round-000004.pt"],
        "checkpoint": "worker-1/round-000004.pt",
    }
    assert line.startswith("worker 0: its newest checkpoint round-000004.pt is damaged (payload is 952 bytes")
    assert line.endswith("; resumed at step 20, after round 4, from worker 1's checkpoint round-000004.pt")
    assert "\n" not in line


def test_a_worker_with_every_checkpoint_damaged_and_no_other_state_starts_afresh_and_says_so(tmp_path):
    _save(tmp_path, 0, 2)
    _save(tmp_path, 0, 4)
    _truncate(tmp_path, 0, 2)
    _truncate(tmp_path, 0, 4)
    resume = choose_resume(tmp_path, 0, model_shapes=SHAPES)
    assert resume.source == "fresh" and resume.state is None
    record, line = told(resume, 0, step=0, round_index=0, caught_up=False)
    assert record["source"] == "fresh" and record["damaged"] == ["worker-0/round-000004.pt", "worker-0/round-000002.pt"]
    assert "round-000004.pt, round-000002.pt are damaged" in line and line.endswith("STARTS AFRESH at step 0")
    # a live peer rounds ahead served its state: that is what it says instead
    record, line = told(resume, 0, step=15, round_index=3, caught_up=True)
    assert record["source"] == "live run" and line.endswith("; took the live run's state after round 3 (step 15)")
    # a new worker (nothing on disk) has nothing to tell
    assert (
        told(choose_resume(tmp_path / "new", 0, model_shapes=SHAPES), 0, step=0, round_index=0, caught_up=False) is None
    )


def test_a_simulated_run_whose_worker_lost_its_newest_checkpoint_goes_on_as_one_model(tmp_path):
    """Two workers (simulated, in this process) train 4 rounds; worker 0's newest checkpoint is cut
    short; the run goes on to 6 rounds: worker 0 resumes from worker 1's round 4 and both end on
    the same params (from its own round 3 it would train round 4 alone and fork)."""

    def run(steps: int) -> dict:
        cfg = load_config(
            None,
            [*TINY_SIM, f"inner.steps={steps}", f"run.dir={tmp_path}", "comm.run_id=resume_sim"],
        )
        return simulate(cfg, workers=2)

    run(20)
    _truncate(tmp_path / "checkpoints", 0, 4)
    summary = run(30)
    records = [json.loads(line) for line in (tmp_path / "worker-0.jsonl").read_text().splitlines()]
    resumed = [r for r in records if r["event"] == "resume"]
    assert [(r["source"], r["round"], r["damaged"]) for r in resumed] == [("worker 1", 4, ["worker-0/round-000004.pt"])]
    assert summary["failed_workers"] == [] and summary["params_agree"], summary["param_sha256"]
