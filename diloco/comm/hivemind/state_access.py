"""Who may download a peer's state: in a keyed run (``run_key.py``), only a peer that proves it
holds the run key; in an open run, anyone who reaches the peer (it says so once at its start).

hivemind 1.1.12's download request carries no token, so ours carries a proof in its metadata
(MSGPack, under ``PROOF``): the time it was made and an HMAC-SHA256 tag, under a secret derived
from the run key (``run_key.derived_key``, then this use's own label), of the requester's peer
id, the server's peer id and that time. Every request that hands out state checks it: the whole
state (``rpc_download_state``, a helper's relayed state included), a manifest and parts
(``rpc_download_state_part``). The server recomputes the tag for the peer id libp2p
authenticated (the caller's ``P2PContext.remote_id``) and its own, and refuses a request whose
proof is missing, wrong, or made more than ``WINDOW_S`` from its own clock (either way): it
serves nothing, logs one line naming the peer (once per peer), and the requester's call fails
with the reason (``StateRefused``'s message, which names the run key).

Why a time window and no nonce or challenge: a tag names the one peer that may present it, and
libp2p authenticates that peer, so a tag seen by anyone else (the server, a log) is of no use to
them; the peer that made it holds the key anyway. The window only bounds how long a tag leaked
with its maker's identity key stays good. The peers' clocks must agree within it, as the run's
DHT records' expiration times already need.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time

from diloco.comm.hivemind.run_key import derived_key

logger = logging.getLogger(__name__)

PROOF = "proof"  # the key of the proof in a request's metadata: [time, tag]
WINDOW_S = 120.0  # a proof made further than this from the server's clock is stale
REFUSED = "state download refused"  # how a refusal's message starts (what the requester reads)
_LABEL = b"diloco-state-download"
_REMEMBERED = 1024  # the refused peers logged, at most: each once


class StateRefused(Exception):
    """A state request refused (its message: why); hivemind hands the message to the requester."""


def _message(requester: bytes, server: bytes, made: float) -> bytes:
    parts = [_LABEL, requester, server, repr(float(made)).encode()]
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)


class StateAccess:
    """The proofs of run key ``run_key`` ("" = an open run: no proof, everyone is served).
    Peer ids are given as bytes (``PeerID.to_bytes()``)."""

    def __init__(self, run_key: str):
        self._key = hmac.new(derived_key(run_key), _LABEL, hashlib.sha256).digest() if run_key else b""
        self._logged: set[bytes] = set()

    @property
    def keyed(self) -> bool:
        return bool(self._key)

    def _tag(self, requester: bytes, server: bytes, made: float) -> bytes:
        return hmac.new(self._key, _message(requester, server, made), hashlib.sha256).digest()

    def request(self, asked: dict, *, requester: bytes, server: bytes, now: float | None = None) -> dict:
        """``asked`` (a request's metadata) with the proof that ``requester`` may download from
        ``server`` (none in an open run)."""
        if not self.keyed:
            return dict(asked)
        made = time.time() if now is None else now
        return {**asked, PROOF: [made, self._tag(requester, server, made)]}

    def refusal(self, asked: object, *, requester: bytes, server: bytes, now: float | None = None) -> str:
        """Why a request with metadata ``asked`` by ``requester`` must not be served by ``server``
        ("" to serve it)."""
        if not self.keyed:
            return ""
        proof = asked.get(PROOF) if isinstance(asked, dict) else None
        if not (isinstance(proof, list | tuple) and len(proof) == 2):
            return "it carries no proof of the run key"
        made, tag = proof
        if not (isinstance(made, float | int) and isinstance(tag, bytes)):
            return "it carries no proof of the run key"
        if not hmac.compare_digest(tag, self._tag(requester, server, made)):
            return "its proof is not made with the run key (or for another peer)"
        skew = (time.time() if now is None else now) - made
        if abs(skew) > WINDOW_S:
            return f"its proof is {abs(skew):.0f} s {'old' if skew > 0 else 'ahead'} (more than {WINDOW_S:.0f} s)"
        return ""

    def check(self, asked: object, *, requester, server) -> None:
        """Raise ``StateRefused`` unless ``requester`` (a ``PeerID``) may be served by ``server``
        with metadata ``asked``, logging the refusal once per peer."""
        why = self.refusal(asked, requester=requester.to_bytes(), server=server.to_bytes())
        if not why:
            return
        peer = requester.to_bytes()
        if peer not in self._logged and len(self._logged) < _REMEMBERED:
            self._logged.add(peer)
            logger.warning("refused to serve our state to peer %s: %s", requester, why)
        raise StateRefused(f"{REFUSED}: {why}; this run is keyed: set comm.run_key or $DILOCO_RUN_KEY")


def say_if_open(run_key: str, *, who: str, what: str) -> None:
    """One line at the start of a peer that serves ``what`` in an open run (``run_key`` "")."""
    if not run_key:
        logger.info("this run has no key: anyone who reaches this %s can download %s", who, what)
