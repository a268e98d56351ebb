"""Real workers in real processes averaging over hivemind on loopback, launched exactly as a
user would: ``diloco local``."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from tests.conftest import TINY, log_tails, read_records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _round_hashes(run_dir, workers: int) -> dict[int, set[str]]:
    by_round: dict[int, set[str]] = {}
    for worker in range(workers):
        for record in read_records(run_dir, worker):
            if record["event"] == "round":
                by_round.setdefault(record["round"], set()).add(record["param_sha256"])
    return by_round


@pytest.mark.parametrize("workers", [4])  # a missed round and a crash: tests/integration/test_volunteer.py
def test_workers_train_and_hold_identical_params_after_every_round(tmp_path, diloco_cli, workers):
    run_dir = tmp_path / "run"
    done = diloco_cli(
        "local",
        "--workers",
        str(workers),
        "--run-dir",
        str(run_dir),
        *TINY,
        "inner.steps=40",
        "outer.sync_every=10",
    )
    assert done.returncode == 0, done.stdout[-4000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["workers"] == workers and summary["rounds"] == 4 and summary["failed_workers"] == []
    assert len(set(summary["param_sha256"])) == 1
    hashes = _round_hashes(run_dir, workers)
    assert sorted(hashes) == [1, 2, 3, 4]
    assert all(len(h) == 1 for h in hashes.values()), hashes  # every round: one hash across workers

    every = [r for w in range(workers) for r in read_records(run_dir, w) if r["event"] == "round"]
    # a worker whose part hivemind lost (its reducers drop inputs under load: seen in CI) takes the
    # others' state instead, so every record averaged or recovered, and the whole group averaged
    # (or, when a reducer averaged a part without a sender, the round says so: partial, same params)
    assert all(r["ok"] or r["recovered"] or r["partial"] for r in every), every
    assert any(r["ok"] and r["peers"] == workers for r in every), every
    # it learns past the bytes' unigram entropy (3.32 nats; ln 256 = 5.55 at init): 3.01 after round 4.
    # Not asserted falling round by round: Nesterov momentum over only four rounds, as the inner lr
    # decays, overshoots (2.90 at round 2, 3.01 at round 4); a CI run that lost a round (112 s) began at 2.87
    val_losses = [r["val_loss"] for r in read_records(run_dir, 0) if r["event"] == "round"]
    assert val_losses[-1] < 3.15, val_losses
    assert summary["bytes_sent"] > 0 and summary["tokens"] == workers * 40 * 8 * 32
    assert (run_dir / "config.yaml").exists()
    assert "identical" in done.stdout
    assert "Warning" not in done.stdout  # the launcher's terminal: progress and the summary, no noise


def test_rerunning_a_stopped_run_resumes_from_its_checkpoint(tmp_path, diloco_cli):
    run_dir = tmp_path / "run"
    common = [
        "local",
        "--workers",
        "2",
        "--run-dir",
        str(run_dir),
        *TINY,
        "inner.steps=40",
        "outer.sync_every=10",
        "checkpoint.every_rounds=1",
    ]
    stopped = diloco_cli(*common, "faults.stop_after_round=2")
    assert stopped.returncode == 3  # the workers "crashed" after round 2, as asked
    assert not any(r["event"] == "end" for r in read_records(run_dir, 0))

    resumed = diloco_cli(*common)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    for worker in range(2):
        records = read_records(run_dir, worker)
        rounds = [r["round"] for r in records if r["event"] == "round"]
        assert rounds == [1, 2, 3, 4]  # rounds 1-2 before the stop, 3-4 after: none repeated
        steps = [r["step"] for r in records if r["event"] == "step"]
        assert steps == sorted(steps) and steps[0] == 1 and steps[-1] == 40  # each process's first step, then every 5
    assert len(set(_round_hashes(run_dir, 2)[4])) == 1


@pytest.mark.timeout(480)
def test_a_worker_whose_newest_checkpoint_is_damaged_resumes_from_the_others_and_the_run_stays_one_model(
    tmp_path, diloco_cli
):
    run_dir = tmp_path / "run"
    common = ["local", "--workers", "2", "--run-dir", str(run_dir), *TINY, "outer.sync_every=5"]
    first = diloco_cli(*common, "inner.steps=20")
    assert first.returncode == 0, first.stdout[-4000:]
    newest = sorted((run_dir / "checkpoints" / "worker-0").glob("round-*.pt"))[-1]
    assert newest.name == "round-000004.pt"  # its own round 3 is kept too (checkpoint.keep=2)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

    def resumed(worker: int) -> list[tuple]:
        records = read_records(run_dir, worker)
        return [(r["source"], r["round"], r["damaged"]) for r in records if r["event"] == "resume"]

    # the same command: the run is over; from its own round 3 worker 0 would train round 4 alone
    again = diloco_cli(*common, "inner.steps=20")
    assert again.returncode == 0, again.stdout[-4000:]
    took_worker_1s = ("worker 1", 4, ["worker-0/round-000004.pt"])
    assert resumed(0) == [took_worker_1s], log_tails(run_dir, 2)
    assert json.loads((run_dir / "summary.json").read_text())["params_agree"], again.stdout[-2000:]
    line = "worker 0: its newest checkpoint round-000004.pt is damaged"
    assert line in (run_dir / "worker-0.log").read_text()

    # with more steps the run goes on, as one model
    more = diloco_cli(*common, "inner.steps=30")
    assert more.returncode == 0, more.stdout[-4000:]
    assert resumed(0) == [took_worker_1s] * 2, log_tails(run_dir, 2)
    assert resumed(1) == [("own", 4, [])] * 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["params_agree"] and summary["inner_steps"] == 30, summary
    hashes = _round_hashes(run_dir, 2)
    assert sorted(hashes) == [1, 2, 3, 4, 5, 6] and all(len(h) == 1 for h in hashes.values()), hashes


@pytest.mark.parametrize(
    "overlap",
    [
        ["outer.overlap=delayed"],
        ["outer.overlap=streaming", "outer.fragments=2", "outer.delay_steps=2"],
        ["outer.overlap=streaming", "outer.fragments=2", "outer.delay_steps=2", "comm.hivemind.data_plane=gloo"],
    ],
    ids=["delayed", "streaming", "streaming-over-the-gloo-data-plane"],
)
def test_overlapped_rounds_over_hivemind_end_on_identical_params(tmp_path, diloco_cli, overlap):
    run_dir = tmp_path / "run"
    done = diloco_cli(
        "local", "--workers", "2", "--run-dir", str(run_dir), *TINY, "inner.steps=40", "outer.sync_every=10", *overlap
    )
    assert done.returncode == 0, done.stdout[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["failed_workers"] == []
    assert summary["params_agree"], summary["param_sha256"]
    rounds = [r for r in read_records(run_dir, 0) if r["event"] == "round"]
    assert len(rounds) == 4, rounds
    # hivemind sometimes loses part of a round for a worker: the round is retried, or
    # one of the two takes the other's state, at once with one fragment (delayed), at the run's end
    # with several (streaming)
    both = [[r for r in read_records(run_dir, w) if r["event"] == "round"] for w in range(2)]
    if "outer.overlap=streaming" in overlap:
        assert all(r["ok"] for r in rounds) or any(w[-1]["recovered"] for w in both), both
    else:
        assert all(all(w[i]["ok"] for w in both) or any(w[i]["recovered"] for w in both) for i in range(4)), both
    # delayed applies nothing in its first round
    assert all(r["peers"] == 2 or not r["ok"] or r["recovered"] for r in rounds[1:]), rounds
    # a fragment at a time: no sync sends much more than half of what a whole round sends. A sync
    # whose first attempt broke and was tried once more (hivemind lost a part) counts both attempts'
    # bytes, up to a whole model's: that run shows nothing about the fragment's size
    retried = any("trying once more" in (run_dir / f"worker-{w}.log").read_text() for w in range(2))
    if "outer.overlap=streaming" in overlap and not retried:
        assert summary["peak_sync_bytes"] < 0.6 * summary["bytes_sent"] / 4, log_tails(run_dir, 2)


def _release_when_recorded(run_dir, worker: int, release, stop: threading.Event, timeout_s: float = 120.0) -> None:
    """Create ``release`` once ``worker`` has recorded its first round (or at ``timeout_s``)."""
    records, deadline = run_dir / f"worker-{worker}.jsonl", time.monotonic() + timeout_s
    while not stop.is_set() and time.monotonic() < deadline:
        if records.exists() and '"event": "round"' in records.read_text():
            break
        stop.wait(0.2)  # polling a file another process writes
    release.touch()


def test_a_streaming_worker_that_came_a_whole_average_late_catches_up_instead_of_trailing_for_good(
    tmp_path, diloco_cli
):
    """Worker 2 computes 3 s a step until the others have recorded their first round: it comes to
    fragment 0's first average after the others averaged it without it (and fragment 1's). It stops
    looking for those groups once their records say they are done with them, instead of looking
    until its deadline and arriving a whole average late at every one after (while the others waited
    their matchmaking window for it at each); it averages with both from then on."""
    run_dir, release, stop = tmp_path / "run", tmp_path / "release", threading.Event()
    releaser = threading.Thread(target=_release_when_recorded, args=(run_dir, 0, release, stop))
    releaser.start()
    try:
        done = diloco_cli(
            "local", "--workers", "3", "--run-dir", str(run_dir), *TINY,
            "inner.steps=40", "outer.sync_every=10", "outer.overlap=streaming", "outer.fragments=2",
            "outer.delay_steps=2", "comm.hivemind.matchmaking_s=8", "comm.deadline_s=30",
            "faults.worker=2", "faults.step_delay_s=3", f"faults.step_delay_until={release}",
        )  # fmt: skip
    finally:
        stop.set()
        releaser.join()
    assert done.returncode == 0, done.stdout[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["params_agree"], (summary["param_sha256"], log_tails(run_dir, 3))
    late = [r for r in read_records(run_dir, 2) if r["event"] == "round"]
    # it caught up: after its first round it averaged with both (every later round, unless hivemind
    # lost a part of one); trailing, it would average with nobody in any
    assert any(r["peers"] == 3 and r["ok"] for r in late[1:]), (late, log_tails(run_dir, 3))
    assert "done with this round's average" in (run_dir / "worker-2.log").read_text(), log_tails(run_dir, 3)


def _run_with_a_blown_up_sender(run_dir, diloco_cli, *overrides: str) -> None:
    """3 workers, 2 rounds; worker 2 sends 100 x its pseudo-gradient."""
    done = diloco_cli(
        "local",
        "--workers",
        "3",
        "--run-dir",
        str(run_dir),
        *TINY,
        "inner.steps=20",
        "outer.sync_every=10",
        "faults.worker=2",
        "faults.bad_payload=scaled",
        *overrides,
    )
    assert done.returncode == 0, done.stdout[-4000:]


def test_a_worker_sending_a_blown_up_pseudo_gradient_is_dropped_by_every_peer(tmp_path, diloco_cli):
    run_dir = tmp_path / "run"
    _run_with_a_blown_up_sender(run_dir, diloco_cli)
    logs = [(run_dir / f"worker-{w}.log").read_text() for w in range(3)]
    peer_id = re.search(r"worker 2 is up; join this run with: .*?/p2p/(\w+)", logs[2]).group(1)
    # it was refused in each group it averaged in (in every round but when a leader counted it in a
    # group it had given up on, late: then only the others refused it, and it took their state)
    own_drops = logs[2].count("dropped our own contribution: its norm")
    assert own_drops >= 1, logs[2][-3000:]
    # every honest peer refused it, naming it and the median, in each group it shared with it: as
    # often as it refused itself, the two together (hivemind's matchmaking can leave one honest peer out of
    # a round's group, late: the attacker is then refused by the other alone)
    pattern = rf"dropped the contribution of peer {peer_id}: its norm \S+ is more than 10 x the median"
    drops = [len(re.findall(pattern, log)) for log in logs[:2]]
    assert all(drops) and sum(drops) >= own_drops, (drops, own_drops, log_tails(run_dir, 3))
    rounds = [[r for r in read_records(run_dir, w) if r["event"] == "round"] for w in range(3)]
    for honest in rounds[:2]:  # the mean of the two honest ones (a part hivemind lost: partial, or recovered)
        assert all((r["ok"] and r["peers"] == 2) or r["partial"] or r["recovered"] for r in honest), honest
    assert all(not r["ok"] and r["recovered"] for r in rounds[2]), f"{rounds[2]}\n{log_tails(run_dir, 3)}"
    ends = [[r for r in read_records(run_dir, w) if r["event"] == "end"][0] for w in range(3)]
    assert len({end["param_sha256"] for end in ends}) == 1, ends
    assert rounds[0][-1]["val_loss"] < 3.2  # learned; the 100 x update would have thrown it far off


def test_a_streaming_worker_whose_contributions_are_dropped_ends_on_the_others_params(tmp_path, diloco_cli):
    # with several fragments a worker whose averages failed takes a peer's state only at the run's end
    # (diloco/core/overlap.py); without that it would end on params of its own
    run_dir = tmp_path / "run"
    _run_with_a_blown_up_sender(
        run_dir, diloco_cli, "outer.overlap=streaming", "outer.fragments=2", "outer.delay_steps=2"
    )
    dropped = [r for r in read_records(run_dir, 2) if r["event"] == "round"]
    ends = [[r for r in read_records(run_dir, w) if r["event"] == "end"][0]["param_sha256"] for w in range(3)]
    assert ends[0] == ends[1], f"the honest workers differ\n{log_tails(run_dir, 3)}"
    assert not any(r["ok"] for r in dropped), f"{dropped}\n{log_tails(run_dir, 3)}"
    # hivemind's matchmaking sometimes leaves one peer out of a group the others formed with it (seen
    # in CI: "could not find a group" on its side, a part missing on theirs); the dropped worker
    # then runs a deadline behind and may find the others gone at its run's end
    left_behind = "could not find a group" in (run_dir / "worker-2.log").read_text()
    if not left_behind:
        assert dropped[-1]["recovered"] and ends[2] == ends[0], f"{dropped}\n{log_tails(run_dir, 3)}"
