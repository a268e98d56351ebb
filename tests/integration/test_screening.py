"""Key holders attacking a run of real hivemind peers: one worker of four sends minus 9 x its
pseudo-gradient, inside the norm bound (``diloco local``), and every reducer leaves it out of the
parts it averages (``comm.min_cosine``), then every peer excludes it (``comm.exclude_after``); one
offers a poisoned state under a huge claimed rank, and the worker that looks for a state refuses it
and takes an honest one. Every peer ends on the same params."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from diloco.bench.faults import Cluster
from tests.conftest import TINY, log_tails, read_records

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ATTACKER = 3


@pytest.mark.parametrize("outer", [[], ["outer.optimizer=sparseloco"]], ids=["averaged", "sparseloco-top-k-gathered"])
def test_a_worker_sending_minus_nine_times_its_pseudo_gradient_is_left_out_by_every_reducer(
    tmp_path, diloco_cli, outer
):
    run_dir = tmp_path / "run"
    done = diloco_cli(
        "local",
        "--workers",
        "4",
        "--run-dir",
        str(run_dir),
        *TINY,
        "inner.steps=40",
        "outer.sync_every=10",
        f"faults.worker={ATTACKER}",
        "faults.bad_payload=scaled",
        "faults.payload_scale=-9",
        "comm.min_cosine=0",
        "comm.exclude_after=2",
        *outer,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    logs = [(run_dir / f"worker-{w}.log").read_text() for w in range(4)]
    ids = [re.search(rf"worker {w} is up; join this run with: .*?/p2p/(\w+)", logs[w]).group(1) for w in range(4)]
    left_out = [re.findall(r"left the contribution of peer (\w+) out of \d+ of the \d+ parts", log) for log in logs]
    # every reducer (the attacker's own too) left it out of the parts it reduced; a part of this tiny
    # model may leave an honest one out now and then (its cosine to the median is noisy): not asserted
    assert all(ids[ATTACKER] in found for found in left_out), f"{left_out}\n{log_tails(run_dir, 4)}"
    assert "does not point the others' way" in logs[0]
    ends = [[r for r in read_records(run_dir, w) if r["event"] == "end"][0] for w in range(4)]
    assert len({end["param_sha256"] for end in ends}) == 1, ends
    rounds = [r for w in range(4) for r in read_records(run_dir, w) if r["event"] == "round"]
    # the records count the contributions in the mean: the attacker's is not (a part hivemind lost
    # makes a round partial or recovered, as in any run)
    assert all(r["peers"] <= 3 or not r["ok"] for r in rounds), rounds
    if not outer:
        assert any(r["ok"] and r["peers"] == 3 for r in rounds), rounds
    # top-k values of this tiny model, a part at a time, point the others' way only weakly: a part
    # of the attacker's now and then is kept (the round is then partial), its own reducer's parts
    # even once excluded (a peer never refuses its own); every peer holds the same mean all the same
    # learned; minus 9 x would have thrown it off (unscreened: about 20 with top-k)
    assert read_records(run_dir, 0)[-1]["val_loss"] < (4.0 if outer else 3.2)
    # left out of rounds 1 and 2 by every reducer: excluded by every honest peer from round 2 on (its
    # parts left out of every sum before any screening from round 3 on). Over top-k parts a peer
    # counts a round against the attacker only when its own reducer left it out of at least half
    # of the parts it reduced, and the top-k parts of this tiny model point the others' way now and
    # then (3 of 7 left out: that peer's count starts again): every peer ends on the same params
    # all the same, and some honest peer excludes it
    said = f"excluded peer {ids[ATTACKER]} from the run's means: left out of 2 rounds in a row"
    excluding = [w for w in range(ATTACKER) if said in logs[w]]
    wanted = list(range(ATTACKER)) if not outer else excluding  # every honest peer; over top-k, some
    assert excluding and excluding == wanted, f"{excluding}\n{log_tails(run_dir, 4)}"
    for w in excluding:
        excluded = [r.get("excluded", []) for r in read_records(run_dir, w) if r["event"] == "round"]
        if not outer:
            # rounds 3 and 4: the last two records (a worker that lost a round and took a peer's
            # state after the next one has a record fewer)
            assert excluded[-2:] == [[ATTACKER], [ATTACKER]], excluded
        else:  # from the record of the round it was excluded in, or the next, to the last
            since = next((i for i, e in enumerate(excluded) if e), len(excluded))
            assert excluded[since:] == [[ATTACKER]] * (len(excluded) - since), excluded


def _poisoned_run(run_dir: Path) -> list[str]:
    """Worker 2 offers its state with other params, ranked as if a million workers averaged it;
    worker 1 sits out round 2, so it looks for the others' state. The workers' logs."""
    # matchmaking 5 s: the others wait that long for worker 1 in round 2, and the poisoner lingers at
    # the end for as long (its offer outranks every other)
    settings = [*TINY, "inner.steps=40", "outer.sync_every=10", "worker.count=3", "comm.run_id=poison",
                "comm.hivemind.matchmaking_s=5"]  # fmt: skip
    with Cluster([*settings, "checkpoint.every_rounds=0"], run_dir, slots=3) as cluster:
        cluster.start(0)
        cluster.start(1, ["faults.worker=1", "faults.skip_round=2"])
        cluster.start(2, ["faults.worker=2", "faults.poison_state=true"])
        codes = cluster.wait_all(240)
    assert codes == {0: 0, 1: 0, 2: 0}, log_tails(run_dir, 3)
    ends = [[r for r in read_records(run_dir, w) if r["event"] == "end"][0] for w in range(3)]
    assert len({end["param_sha256"] for end in ends}) == 1, ends  # nobody holds the poisoned params
    return [(run_dir / f"worker-{w}.log").read_text() for w in range(3)]


def test_a_poisoned_state_offer_is_refused_by_the_worker_that_looks_for_a_state_and_an_honest_one_taken(tmp_path):
    logs = _poisoned_run(tmp_path / "run")
    if "refused the state of peer" not in logs[1] and "took the state of a peer (2 peers)" in logs[1]:
        # worker 1 reads the offers every half second and takes the first that ranks above its own:
        # the two others offer the moment round 2 ends, and a read between the honest offer and the
        # poisoned one (tens of milliseconds apart) took the honest one (of the group of 2; the
        # poisoner claims 999) without seeing the other. Run once more: a poisoned offer that is
        # never tried, or taken (999 peers), fails either way
        logs = _poisoned_run(tmp_path / "again")
    poisoner = re.search(r"worker 2 is up; join this run with: .*?/p2p/(\w+)", logs[2]).group(1)
    refused = re.findall(r"refused the state of peer (\w+) after round (\d+): its params \(digest", logs[1])
    tails = "\n".join(f"--- worker {w}\n{log[-2000:]}" for w, log in enumerate(logs))
    assert refused and {peer for peer, _ in refused} == {poisoner}, tails
    assert "took the state of a peer (2 peers)" in logs[1], tails
