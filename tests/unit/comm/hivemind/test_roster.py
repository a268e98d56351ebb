"""The roster (who a round waits for) and the run key (who may write the run's records)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
from hivemind.dht.validation import DHTRecord

from diloco.comm.hivemind.helper_record import HelperRecord, live_helpers
from diloco.comm.hivemind.peer import bounded_dht_call
from diloco.comm.hivemind.roster import HEARTBEAT_S, PartialRead, Roster, free_slot
from diloco.comm.hivemind.run_key import RunKeyValidator, keyed_schema_hash
from diloco.comm.run_key_env import resolve_run_key
from tests.hivemind_fakes import RecordsDHT


class _SilentDHT:
    """A DHT process that takes every request and never answers (stuck, or its daemon gone)."""

    def store(self, key, **kwargs):
        return Future()

    def get(self, key, **kwargs):
        return Future()


def _roster(dht, index: int, planned: int, timeout_s: float = 5.0, heartbeat_s: float = HEARTBEAT_S) -> Roster:
    call = bounded_dht_call(dht, threading.Lock(), timeout_s=timeout_s)
    return Roster(call, run_id="r", worker_index=index, planned=planned, heartbeat_s=heartbeat_s)


def test_a_round_expects_the_plan_until_a_worker_is_seen_gone_and_counts_those_who_joined():
    dht = RecordsDHT()
    me, other = _roster(dht, 0, planned=3), _roster(dht, 1, planned=3)
    me._publish(), other._publish()
    assert me.expected() == 3  # worker 2 has not shown up yet: still expected
    del dht.records[1]  # worker 1's heartbeat expired (crashed, or cut off)
    assert me.expected() == 2
    joiner = _roster(dht, 3, planned=3)
    joiner._publish()
    assert me.expected() == 3  # 0 and 2 of the plan, and 3 who joined
    joiner.leave()
    assert me.expected() == 2 and dht.records[3]["leaving"]


def test_a_worker_is_alone_once_every_other_left_cleanly(tmp_path):
    dht = RecordsDHT()
    me, other, third = _roster(dht, 0, planned=3), _roster(dht, 1, planned=3), _roster(dht, 2, planned=3)
    me._publish(), other._publish()
    assert not me.others_gone()
    other.leave()
    assert me.others_gone() and not me.missing  # the only other worker seen has finished: nobody to wait for
    third._publish()
    assert not me.others_gone()  # one came (back): groups again


def test_a_worker_whose_heartbeats_stopped_is_gone_a_ttl_after_its_record_expired():
    now = [100.0]
    dht = RecordsDHT()
    call = bounded_dht_call(dht, threading.Lock(), timeout_s=5.0)
    me = Roster(call, run_id="r", worker_index=0, planned=2, clock=lambda: now[0])
    other = _roster(dht, 1, planned=2)
    me._publish(), other._publish()
    assert not me.others_gone()
    del dht.records[1]  # its heartbeat expired without a word: killed, crashed or cut off
    now[0] += me.ttl_s - 1
    assert not me.others_gone()  # a heartbeat late under load is not a crash yet
    now[0] += 1
    assert me.others_gone() and me.missing == {1}  # alone at once from now on, and it may have drifted
    other._publish()
    assert not me.others_gone()  # it is back: groups again


def test_a_worker_serves_alone_while_every_other_is_a_client_and_no_server_went_missing():
    dht = RecordsDHT()
    call = bounded_dht_call(dht, threading.Lock(), timeout_s=5.0)
    me = _roster(dht, 0, planned=3)
    client = Roster(call, run_id="r", worker_index=1, planned=3, serves_state=False)
    me._publish(), client._publish()
    assert not me.serves_alone()  # worker 2 of the plan not seen yet: it may serve a state of its own
    other_client = Roster(call, run_id="r", worker_index=2, planned=3, serves_state=False)
    other_client._publish()
    assert me.serves_alone()  # clients take states, never serve one
    server = _roster(dht, 2, planned=3)
    server._publish()
    assert not me.serves_alone()
    del dht.records[2]  # gone without leaving: it may train on apart, with a state of its own
    assert not me.serves_alone()
    server.leave()
    assert me.serves_alone()  # it left cleanly: its state is nobody's to take any more
    server._leaving = False
    server._publish()
    assert not me.serves_alone()  # back under the same index


def test_a_read_without_this_workers_own_record_says_nothing_of_who_is_gone():
    # a lookup from a peer in client mode may find only part of the records: were it trusted, the
    # others would look gone, and a client would give up rounds it could have averaged
    dht = RecordsDHT()
    me, other = _roster(dht, 0, planned=2), _roster(dht, 1, planned=2)
    me._publish(), other._publish()
    assert me.expected() == 2
    del dht.records[0]
    with pytest.raises(PartialRead):
        me.expected()
    with pytest.raises(PartialRead):
        me.others_gone()


@pytest.mark.timeout(30)
def test_a_dht_that_never_answers_costs_a_heartbeat_and_a_read_their_bound_not_a_hang():
    roster = _roster(_SilentDHT(), 0, planned=2, timeout_s=0.2)
    started = time.monotonic()
    roster._publish()  # a missed heartbeat: logged at debug, the next one may go through
    with pytest.raises(TimeoutError, match="the DHT did not answer within 0.2 s"):
        roster.entries()
    assert time.monotonic() - started < 5


def test_a_newcomer_takes_the_lowest_free_slot_and_none_when_the_run_is_full():
    dht = RecordsDHT()
    for index in (0, 1, 3):
        _roster(dht, index, planned=4)._publish()
    entries = _roster(dht, 0, planned=4).entries()
    assert free_slot(entries, 5) == 2 and free_slot(entries, 2) is None
    _roster(dht, 1, planned=4).leave()
    assert free_slot(_roster(dht, 0, planned=4).entries(), 2) == 1


def test_records_signed_with_the_run_key_validate_and_others_do_not():
    validator = RunKeyValidator("secret")
    record = DHTRecord(b"run.roster", b"\x01", b"payload", 1234.5)
    signed = DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)
    assert validator.validate(signed) and validator.strip_value(signed) == b"payload"
    assert not RunKeyValidator("guess").validate(signed)
    assert not validator.validate(DHTRecord(record.key, record.subkey, b"payload", record.expiration_time))
    tampered = DHTRecord(record.key, record.subkey, b"PAYLOAD" + signed.value[7:], record.expiration_time)
    assert not validator.validate(tampered)
    later = DHTRecord(record.key, record.subkey, signed.value, record.expiration_time + 60)
    assert not validator.validate(later)  # the tag covers the expiration: a record cannot be kept alive


def test_the_schema_hash_is_a_token_only_key_holders_can_present(monkeypatch):
    schema = b"\x00" * 32
    assert keyed_schema_hash("", schema) == schema
    assert keyed_schema_hash("a", schema) == keyed_schema_hash("a", schema) != keyed_schema_hash("b", schema)
    monkeypatch.setenv("DILOCO_RUN_KEY", "from-env")
    assert resolve_run_key("") == "from-env" and resolve_run_key("given") == "given"


def test_workers_cut_off_are_missing_with_the_addresses_they_announced_until_they_are_back():
    dht = RecordsDHT()
    me, other, third = (_roster(dht, i, planned=3) for i in range(3))
    other.addresses = ["/ip4/10.0.0.2/tcp/1/p2p/B"]
    for roster in (me, other, third):
        roster._publish()
    assert me.expected() == 3 and me.missing == set()
    del dht.records[1]  # its heartbeat expired without a word: crashed, or cut off (a split run)
    third.leave()  # the third left cleanly: not missing
    me.expected()
    assert me.missing == {1} and me.addresses_of(1) == ("/ip4/10.0.0.2/tcp/1/p2p/B",)
    other._publish()  # reachable again
    me.expected()
    assert me.missing == set()


def test_a_roster_reports_the_digest_of_the_params_it_declared_after_the_last_round_and_not_its_telemetry():
    me = _roster(RecordsDHT(), 0, planned=2)
    assert me.model == ""  # before the first round: nothing to compare
    me.progress(1, 20, {"val_loss": 3.0, "params": "abc123"})  # figures for diloco status declare nothing
    assert me.model == ""
    me.declare_params(1, "def456" * 4, peers=2)
    assert me.model == "def456" * 2 + "def4"  # the first 16 hex digits


def test_a_worker_announces_the_shapes_it_averages_and_the_group_it_waits_for_and_a_bad_layout_reads_as_none():
    dht = RecordsDHT()
    call = bounded_dht_call(dht, threading.Lock(), timeout_s=5.0)
    roster = Roster(call, run_id="r", worker_index=0, planned=1, layout=[[(4, 2), (3,)]])
    roster.group = 4
    roster._publish()
    entry = _roster(dht, 1, 1).entries()[0]
    assert entry.protocol.layout == (((4, 2), (3,)),) and entry.protocol.group == 4
    dht.records[0]["protocol"]["layout"] = [["not", "a shape"]]
    assert _roster(dht, 1, 1).entries()[0].protocol.layout == ()


def test_a_worker_announces_per_fragment_the_rounds_whose_average_it_is_done_with_and_the_last_it_postponed():
    dht = RecordsDHT()
    roster = _roster(dht, 0, 1)
    for fragment, round_index in [(1, 4), (0, 2), (1, 3)]:  # a round done earlier never lowers the count
        roster.finished_averaging(fragment, round_index)
    roster._publish()
    state = _roster(dht, 1, 1).entries()[0].protocol
    assert state.averaged == (3, 5) and state.postponed == (0, 0)  # said: none postponed, not "not said"
    roster.postponed_averaging(1, 3)
    roster._publish()
    state = _roster(dht, 1, 1).entries()[0].protocol
    assert state.averaged == (3, 5) and state.postponed == (0, 4)  # one count per fragment each
    for bad in (["3"], 7, [True]):  # not counts: a peer of another version says nothing
        dht.records[0]["protocol"]["averaged"] = dht.records[0]["protocol"]["postponed"] = bad
        state = _roster(dht, 1, 1).entries()[0].protocol
        assert state.averaged == () and state.postponed == ()


def test_the_end_of_an_average_is_announced_at_once():
    announced = threading.Event()

    class _Watched(RecordsDHT):
        def store(self, key, *, subkey, value, expiration_time, return_future):
            if value["protocol"]["averaged"]:
                announced.set()
            return super().store(key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)

    roster = _roster(_Watched(), 0, 2)
    roster.start()
    try:
        started = time.monotonic()
        roster.finished_averaging(0, 0)
        assert announced.wait(HEARTBEAT_S), "not announced before the next heartbeat"
        assert time.monotonic() - started < HEARTBEAT_S
    finally:
        roster.stop()


def test_a_round_that_starts_looking_for_its_group_is_announced_at_once():
    announced = threading.Event()

    class _Watched(RecordsDHT):
        def store(self, key, *, subkey, value, expiration_time, return_future):
            if value["protocol"]["stage"] == "matchmaking" and value["shows"]["phase"] == "matchmaking":
                announced.set()
            return super().store(key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)

    roster = _roster(_Watched(), 0, 2)
    roster.phase("averaging", time.time())
    roster.start()
    try:
        started = time.monotonic()
        roster.stage("matchmaking")
        assert announced.wait(HEARTBEAT_S), "not announced before the next heartbeat"
        assert time.monotonic() - started < HEARTBEAT_S
    finally:
        roster.stop()


def test_the_digest_after_a_round_is_announced_at_once_and_a_step_waits_for_the_heartbeat():
    announced, steps = threading.Event(), []

    class _Watched(RecordsDHT):
        def store(self, key, *, subkey, value, expiration_time, return_future):
            steps.append(value["step"])
            if value.get("params", {}).get("round") == 3:
                announced.set()
            return super().store(key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)

    roster = _roster(_Watched(), 0, 2, heartbeat_s=60.0)
    roster.start()
    try:
        roster.progress(2, 41, {"loss": 1.0})  # a step: sent with the next heartbeat, a minute away
        roster.progress(3, 60, {"loss": 1.0})
        roster.declare_params(3, "ab", peers=2)  # a round's digest: at once
        assert announced.wait(10), "the digest waited for the next heartbeat"
        assert 41 not in steps  # the step alone woke nobody
    finally:
        roster.stop()


def test_extra_records_between_heartbeats_leave_the_chores_their_pace():
    chores_ran = threading.Event()
    roster = _roster(RecordsDHT(), 0, 2, heartbeat_s=0.5)
    roster.chores.append(chores_ran.set)
    roster.phase("averaging", time.time())
    roster.start()
    try:
        deadline = time.monotonic() + 3 * roster.heartbeat_s
        while not chores_ran.is_set() and time.monotonic() < deadline:
            roster.stage("matchmaking")  # rounds far shorter than a heartbeat: a record at the start of each
            roster.stage(None)
            chores_ran.wait(0.1)
        assert chores_ran.is_set(), "the chores never ran while rounds kept starting"
    finally:
        roster.stop()


def test_a_client_knows_when_no_worker_that_serves_a_state_was_seen():
    dht = RecordsDHT()
    client = _roster(dht, 0, 2)
    client.serves_state = False
    client._publish()
    client.expected()
    assert client.no_server_seen()
    server = _roster(dht, 1, 2)
    server._publish()
    client.expected()
    assert not client.no_server_seen()
    server.leave()
    client.expected()
    assert client.no_server_seen()  # it left cleanly: nobody that could reduce is in the run


def test_live_helpers_count_the_fresh_records_that_are_not_leaving():
    dht = RecordsDHT()
    call = bounded_dht_call(dht, threading.Lock(), timeout_s=5.0)
    assert live_helpers(call, "r") == 0
    first = HelperRecord(call, run_id="r", peer_id="p1", addresses=["/ip4/1.2.3.4/tcp/1"])
    first._publish()
    HelperRecord(call, run_id="r", peer_id="p2", addresses=[])._publish()
    assert live_helpers(call, "r") == 2
    first.leave()
    assert live_helpers(call, "r") == 1
    assert live_helpers(bounded_dht_call(_SilentDHT(), threading.Lock(), timeout_s=0.1), "r") == 0


def test_a_shorter_heartbeat_writes_records_that_live_four_of_them():
    written, three = [], threading.Event()

    class _Expiring(RecordsDHT):
        def store(self, key, *, subkey, value, expiration_time, return_future):
            written.append(expiration_time - value["at"])
            if len(written) == 3:  # the start's record, then one a heartbeat
                three.set()
            return super().store(key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)

    roster = _roster(_Expiring(), 0, 2, heartbeat_s=0.25)
    roster.start()
    try:
        assert three.wait(10), written
    finally:
        roster.stop()
    assert roster.ttl_s == 1.0 and all(abs(life - 1.0) < 1e-6 for life in written), written
