"""Whether others can dial this worker: measured by a peer dialling back, not guessed.

Most volunteers sit behind a home router: they can dial out, nobody can dial in. hivemind's
butterfly all-reduce then loses the parts two such peers would exchange, unless they join as
clients (``comm.hivemind.client_mode``): a client sends its contribution, reduces no part and
serves no state. With ``comm.hivemind.client_mode=auto`` (the default) a joining worker finds out
which it is, in the spirit of libp2p's AutoNAT:

1. it starts its peer as a client, which still listens on its port (so that no peer's routing
   table takes an address that may not answer: every DHT request routed to it would wait out its
   timeout), and writes a dial-back request on the DHT (key ``diloco_dialback``, one subkey per
   peer) with the addresses it announces;
2. every live worker that is not a client, and every bootstrap peer (``diloco bootstrap``), looks
   at the requests about once a heartbeat, opens a plain TCP connection to each address (a fresh
   one: the libp2p connection the requester opened to it says nothing of inbound reachability)
   and writes its verdict under ``diloco_dialback_verdict``;
3. the requester takes the first verdict within ``timeout_s``: reachable (it then starts its peer
   again as a full peer, on the same port), or not (it stays a client). No verdict in time (nobody
   answering yet): it takes itself for reachable.

``first_mode`` says which peers ask: not one that starts a run (nobody to ask), nor one that joins
a run on loopback from loopback (nobody else could tell), nor one on loopback joining a run
elsewhere (nobody there can dial it: a client at once).

The keys do not name the run, so a bootstrap peer answers for every run that uses it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

REQUESTS_KEY = "diloco_dialback"
VERDICTS_KEY = "diloco_dialback_verdict"
DIAL_TIMEOUT_S = 2.0  # one TCP connection attempt to an announced address
_RECORD_TTL_S = 60.0
SERVER, CLIENT, LOOPBACK_CLIENT, ASK = "server", "client", "loopback client", "ask"
_POLL_S = 0.5
_MAX_DIALS = 16  # requests dialled back at the same time
_MAX_ADDRESSES = 8  # a request's addresses dialled, at most


def dialable_addresses(maddrs: list[str]) -> list[tuple[str, int]]:
    """(ip, port) of each ``/ip4/IP/tcp/PORT`` multiaddr a peer announces, loopback left out."""
    found = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) >= 5 and parts[1] == "ip4" and parts[3] == "tcp" and not parts[2].startswith("127."):
            found.append((parts[2], int(parts[4])))
    return found


def listens_where_the_run_cannot_dial(own_maddrs: list[str], initial_peers: list[str]) -> bool:
    """Whether this peer listens on loopback only while the run it joins is reached at other
    addresses (a volunteer on another machine left ``comm.hivemind.host`` at its default): nobody there can
    dial it, so it can only take part as a client."""
    return not dialable_addresses(own_maddrs) and bool(dialable_addresses(initial_peers))


def first_mode(client_mode: str, *, own_maddrs: list[str], initial_peers: list[str]) -> str:
    """How a peer with ``comm.hivemind.client_mode=client_mode`` starts, listening at ``own_maddrs``
    (its configured host and port, and announced address) in a run reached at ``initial_peers``:
    ``SERVER``, ``CLIENT``, ``LOOPBACK_CLIENT`` (auto, but nobody in the run can dial it) or ``ASK``
    (auto: a client that asks the run's peers to dial it back)."""
    if client_mode != "auto":
        return CLIENT if client_mode == "true" else SERVER
    if not initial_peers or not dialable_addresses(own_maddrs):
        return LOOPBACK_CLIENT if listens_where_the_run_cannot_dial(own_maddrs, initial_peers) else SERVER
    return ASK


def can_dial(host: str, port: int, timeout_s: float = DIAL_TIMEOUT_S) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def ask(dht_call: Callable, peer_id: str, addresses: list[tuple[str, int]], *, timeout_s: float) -> bool | None:
    """Ask the run's peers to dial ``addresses`` back; their verdict (reachable or not), or None when
    nobody answered within ``timeout_s``. ``dht_call`` as ``Roster``'s (bounded DHT requests)."""
    from hivemind.utils import get_dht_time

    request = {"addresses": [list(a) for a in addresses], "at": get_dht_time()}
    deadline = time.monotonic() + timeout_s
    dht_call(
        lambda dht: dht.store(
            REQUESTS_KEY, subkey=peer_id, value=request, expiration_time=get_dht_time() + _RECORD_TTL_S,
            return_future=True,
        )
    )  # fmt: skip
    while time.monotonic() < deadline:
        try:
            found = dht_call(lambda dht: dht.get(VERDICTS_KEY, latest=True, return_future=True))
        except TimeoutError:
            found = None
        verdict = _subkey_value(found, peer_id)
        if isinstance(verdict, dict) and verdict.get("request_at") == request["at"]:  # ours, not an old one
            return bool(verdict.get("reachable"))
        time.sleep(_POLL_S)  # the others look once a heartbeat; bounded by the deadline
    return None


def answer(dht_call: Callable, *, own_peer_id: str, answered: dict[str, float]) -> int:
    """Dial back every peer whose request is new since ``answered`` (peer -> request time, kept by
    the caller between calls) and write the verdicts. Returns how many were answered."""
    found = dht_call(lambda dht: dht.get(REQUESTS_KEY, latest=True, return_future=True))
    if found is None or not isinstance(found.value, dict):
        return 0
    new = {}  # peer -> (its request's time, the addresses to dial)
    for peer_id, item in found.value.items():
        request = getattr(item, "value", None)
        if peer_id == own_peer_id or not isinstance(request, dict) or answered.get(peer_id) == request.get("at"):
            continue
        try:
            addresses = [(str(a[0]), int(a[1])) for a in request.get("addresses", []) if len(a) == 2]
        except (TypeError, ValueError):  # whatever a peer wrote: nothing to dial
            addresses = []
        new[peer_id] = (request.get("at"), addresses)
    if not new:
        return 0
    for peer_id, (at, _) in new.items():
        answered[peer_id] = at  # answered once, whatever its dial does
    # every requester dialled at once, each verdict written as its dial ends: one behind NAT costs
    # a whole dial timeout, and the others would wait for it (volunteers starting together ask at once)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(_MAX_DIALS, len(new))) as pool:
        dials = {pool.submit(_dials_back, addresses): peer_id for peer_id, (_, addresses) in new.items()}
        for done in concurrent.futures.as_completed(dials):
            _store_verdict(dht_call, dials[done], {"reachable": done.result(), "request_at": new[dials[done]][0]})
    return len(new)


def _dials_back(addresses: list[tuple[str, int]]) -> bool:
    """Whether one of a request's addresses (at most ``_MAX_ADDRESSES``) takes a connection; an
    address that cannot be dialled at all (a port out of range, say) is not reachable."""
    for host, port in addresses[:_MAX_ADDRESSES]:
        try:
            if can_dial(host, port):
                return True
        except Exception:  # whatever a peer wrote in its request
            continue
    return False


def _store_verdict(dht_call: Callable, peer_id: str, verdict: dict) -> None:
    from hivemind.utils import get_dht_time

    dht_call(
        lambda dht: dht.store(
            VERDICTS_KEY, subkey=peer_id, value=verdict, expiration_time=get_dht_time() + _RECORD_TTL_S,
            return_future=True,
        )
    )  # fmt: skip


def _subkey_value(found, subkey: str):
    if found is None or not isinstance(found.value, dict):
        return None
    item = found.value.get(subkey)
    return getattr(item, "value", None)
