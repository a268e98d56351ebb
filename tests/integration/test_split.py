"""A run split by the network, in real network namespaces: the links between the sides of the run
are cut (``Testbed.split``) in round 2 and healed once every worker has recorded the others missing;
once the run is one model again it is cut a second time, into other sides, and healed the same way.
Every worker must end on one model, and its records must show each split (the workers missing) and
each merge (a round of the whole run, or the state of the other side taken). The first cut is into
two sides of two (a tie: neither side outranks the other), the second leaves one worker alone
against three. Root and iptables only; skipped elsewhere with the testbed's reason."""

from __future__ import annotations

import pytest

from diloco.bench.faults import FaultRun, run_scenario
from diloco.tools import testbed as nets
from tests.conftest import TINY, log_tails, round_records

pytestmark = [
    pytest.mark.integration,
    pytest.mark.xdist_group("testbed"),  # see test_testbed.py
    pytest.mark.timeout(420),
    pytest.mark.skipif(nets.testbed_unavailable(nat=True) is not None, reason=str(nets.testbed_unavailable(nat=True))),
]

# a heartbeat of 2 s: a worker cut off is not waited for 8 s after its last record (12 s at the
# default; a DHT request to a peer across the cut takes up to 3 s to fail, so not much less), and
# rounds of at least 4 s until the run is one model again after the second cut (then at this
# machine's pace): a split is seen in a round or two, and the run was one model again two or three
# rounds after the heal on 2 idle cores, by five beside a busy one; 18 rounds leave room for both
WORKERS, STEPS, SYNC_EVERY = 4, 360, 20
RUN_S = STEPS * 0.2
HEARTBEAT = "comm.hivemind.heartbeat_s=2"
CUTS = (((0, 1), (2, 3)), ((0, 1, 2), (3,)))


def _split_then_merged(rounds: list[dict], others: set[int], start: int) -> int:
    """The index of the first record from ``start`` on that ends a split from ``others`` (the
    whole run averaged together, or the worker took the other side's state), after one that
    recorded ``others`` missing."""
    split = next(i for i in range(start, len(rounds)) if others <= set(rounds[i].get("missing", ())))
    return next(
        i
        for i in range(split + 1, len(rounds))
        if not rounds[i].get("missing")
        and ((rounds[i]["ok"] and rounds[i]["peers"] == WORKERS) or rounds[i].get("sides") or rounds[i]["recovered"])
    )


def test_a_run_split_twice_records_each_split_and_ends_on_one_model_after_each_heal(tmp_path):
    plan = FaultRun(
        overrides=[*TINY, "comm.hivemind.matchmaking_s=8", "comm.deadline_s=20", "logging.log_every=10", HEARTBEAT],
        workers=WORKERS,
        steps=STEPS,
        sync_every=SYNC_EVERY,
        outage_s=1.0,  # healed 1 s after every worker recorded the other side missing
        rate_mbit=0.0,  # links unshaped: the rounds after the last merge at this machine's pace
        cuts=CUTS,
        first_cut_round=2,  # every worker saw the others' records in round 1
        split_run_s=RUN_S,
        timeout_s=360.0,
    )
    result = run_scenario("split", plan, tmp_path)
    run_dir = tmp_path / "split"
    assert set(result.exit_codes.values()) == {0} and len(result.exit_codes) == WORKERS, result
    assert result.params_agree, (result, log_tails(run_dir, WORKERS))
    assert not any("never" in note or "no round left" in note for note in result.notes), result
    for worker in range(WORKERS):
        rounds = round_records(run_dir, worker)
        merged = -1
        for sides in CUTS:
            # each split is seen (the other side missing: the scenario heals only once every worker
            # recorded that) and merged, in order
            (side,) = [side for side in sides if worker in side]
            try:
                merged = _split_then_merged(rounds, set(range(WORKERS)) - set(side), merged + 1)
            except StopIteration:
                raise AssertionError((worker, sides, rounds, log_tails(run_dir, WORKERS))) from None
        assert not rounds[-1].get("missing"), rounds[-1]
