"""What a hivemind worker reads of the others through the roster: who is live (typed, nothing of
hivemind's), and the params each declared, which only a declaration says and telemetry cannot."""

from __future__ import annotations

import threading

from diloco.comm.base import Declared
from diloco.comm.hivemind.membership import HivemindMembership
from diloco.comm.hivemind.peer import bounded_dht_call
from diloco.comm.hivemind.roster import Roster
from diloco.comm.members import LiveWorker
from tests.hivemind_fakes import RecordsDHT


def _worker(dht: RecordsDHT, index: int) -> HivemindMembership:
    call = bounded_dht_call(dht, threading.Lock(), timeout_s=5.0)
    roster = Roster(
        call, run_id="r", worker_index=index, planned=3, addresses=[f"/ip4/10.0.0.{index}/tcp/1/p2p/P{index}"]
    )
    return HivemindMembership(roster, peer=None, num_workers=3)


def test_a_forged_params_key_in_a_workers_telemetry_declares_nothing_and_its_real_digest_stands():
    dht = RecordsDHT()
    me, honest, shows_only = _worker(dht, 0), _worker(dht, 1), _worker(dht, 2)
    forged = {"loss": 2.0, "params": "f" * 16, "params_round": 3, "peers": 9}  # figures for diloco status
    honest.report_progress(3, 60, forged)
    honest.declare_params(3, "a" * 64, peers=2)
    shows_only.report_progress(3, 60, forged)  # it declared nothing: telemetry alone says nothing of its params
    me.declare_params(3, "b" * 64, peers=2)
    for worker in (me, honest, shows_only):
        worker.roster._publish()
    assert me.declared_params() == {1: Declared(3, "a" * 16, 3, "P1", 2)}  # ours is no evidence of the run's
    honest.report_progress(4, 61, {**forged, "params": "e" * 16, "params_round": 4})  # telemetry changes on
    honest.roster._publish()
    assert me.declared_params() == {1: Declared(3, "a" * 16, 4, "P1", 2)}


def test_the_live_workers_are_typed_entries_of_comm_not_the_transports_records():
    dht = RecordsDHT()
    me, other = _worker(dht, 0), _worker(dht, 1)
    other.announce_run({"model.n_layer": 2})
    other.report_progress(2, 40, {"loss": 1.0})
    other.roster._publish()
    me.roster._publish()
    live = me.live_workers()
    assert live == {0: LiveWorker(0, 0, 0), 1: LiveWorker(1, 2, 40, run={"model.n_layer": 2})}
    assert all(type(worker) is LiveWorker for worker in live.values())
