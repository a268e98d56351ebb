"""The proof a state request carries in a keyed run: a server admits the peer that made it with the
run key, for itself, lately; not another key, another requester or server, a stale or missing
proof. An open run admits everyone."""

from __future__ import annotations

import logging

import pytest
from hivemind.p2p import PeerID

from diloco.comm.hivemind.state_access import PROOF, REFUSED, WINDOW_S, StateAccess, StateRefused, say_if_open

KEY = "the-run-key"
REQUESTER, SERVER, OTHER = b"requester-peer-id", b"server-peer-id", b"another-peer-id"
NOW = 1_700_000_000.0


def _proven(access: StateAccess, *, requester: bytes = REQUESTER, server: bytes = SERVER, at: float = NOW) -> dict:
    return access.request({"manifest": True}, requester=requester, server=server, now=at)


def test_a_key_holder_is_admitted_for_itself_and_that_server_within_the_window():
    server = StateAccess(KEY)
    asked = _proven(StateAccess(KEY))
    assert asked["manifest"] is True  # what it asks stays
    assert server.refusal(asked, requester=REQUESTER, server=SERVER, now=NOW) == ""
    assert server.refusal(asked, requester=REQUESTER, server=SERVER, now=NOW + WINDOW_S - 1) == ""
    assert server.refusal(asked, requester=REQUESTER, server=SERVER, now=NOW - WINDOW_S + 1) == ""


def test_a_proof_made_with_another_key_is_refused():
    asked = _proven(StateAccess("another-key"))
    assert "not made with the run key" in StateAccess(KEY).refusal(asked, requester=REQUESTER, server=SERVER, now=NOW)


def test_a_proof_presented_by_another_peer_or_to_another_server_is_refused():
    server, asked = StateAccess(KEY), _proven(StateAccess(KEY))
    assert "for another peer" in server.refusal(asked, requester=OTHER, server=SERVER, now=NOW)
    assert "for another peer" in server.refusal(asked, requester=REQUESTER, server=OTHER, now=NOW)


def test_a_stale_proof_and_one_from_too_far_ahead_are_refused():
    server, asked = StateAccess(KEY), _proven(StateAccess(KEY))
    assert "s old" in server.refusal(asked, requester=REQUESTER, server=SERVER, now=NOW + WINDOW_S + 1)
    assert "s ahead" in server.refusal(asked, requester=REQUESTER, server=SERVER, now=NOW - WINDOW_S - 1)


@pytest.mark.parametrize(
    "asked",
    [{}, None, {"manifest": True}, {PROOF: None}, {PROOF: [NOW]}, {PROOF: [NOW, "text"]}, {PROOF: ["now", b"x"]}],
)
def test_a_request_without_a_proof_is_refused_in_a_keyed_run_and_served_in_an_open_one(asked):
    assert "no proof of the run key" in StateAccess(KEY).refusal(asked, requester=REQUESTER, server=SERVER, now=NOW)
    assert StateAccess("").refusal(asked, requester=REQUESTER, server=SERVER, now=NOW) == ""


def test_an_open_run_adds_no_proof():
    assert StateAccess("").request({"digest": "d"}, requester=REQUESTER, server=SERVER) == {"digest": "d"}


def test_a_refusal_names_the_run_key_to_the_requester_and_the_peer_once_in_the_servers_log(caplog):
    stranger = PeerID.from_base58("QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z")
    server = PeerID.from_base58("QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN")
    access = StateAccess(KEY)
    with caplog.at_level(logging.WARNING, logger="diloco.comm.hivemind.state_access"):
        for _ in range(3):
            with pytest.raises(StateRefused, match=f"^{REFUSED}: .*comm.run_key or \\$DILOCO_RUN_KEY"):
                access.check({}, requester=stranger, server=server)
    assert [r.getMessage() for r in caplog.records] == [
        f"refused to serve our state to peer {stranger}: it carries no proof of the run key"
    ]
    holder = StateAccess(KEY).request({}, requester=stranger.to_bytes(), server=server.to_bytes())
    access.check(holder, requester=stranger, server=server)  # admitted: no error


def test_an_open_run_says_once_that_its_params_are_public_and_a_keyed_one_says_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="diloco.comm.hivemind.state_access"):
        say_if_open(KEY, who="worker", what="its params")
        say_if_open("", who="worker", what="its params")
    assert [r.getMessage() for r in caplog.records] == [
        "this run has no key: anyone who reaches this worker can download its params"
    ]
