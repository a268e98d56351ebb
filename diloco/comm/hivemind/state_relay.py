"""Relayed states: a run whose workers are all clients keeps one model through its helpers.

A client serves no state (nobody can dial it), so in a run of clients alone a worker left out of a
round, one whose group held another model, or a newcomer finds nobody to take the run's state
from. Clients can dial out, and a helper can be dialled, so the state goes through a helper:

1. The worker that looks for a state and finds no peer serving one, while a helper is live, asks
   for it: it declares under the run's wanted key the round it is after and the rank to beat
   (``StateWants.ask``).
2. A client whose state after that round ranks higher (``Wanted.served_by``) uploads it to a live
   helper (``StateUploader``, a thread of its own), unless an offer serves the request already.
3. The helper keeps the best state uploaded by a live worker of the run (the newest round, then the
   best rank: ``RelayedStates``; a round no live worker has reached is refused) and offers it as
   any peer offers its own, at its uploader's round and rank.
   The worker downloads it as it downloads any state, and checks it the same way: its params must
   be those a majority of the run's live workers declared after that round (core/recovery.py), so
   a helper or an uploader cannot hand it other params.

What it costs: a state crosses the uploader's link once and the helper's twice, only when a
worker asks; clients that answer one request at once all upload (the helper keeps one). A client
reads the requests once a second while no worker that serves a state has been seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import torch
from hivemind import DHT
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import iter_as_aiter
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming

from diloco.comm.base import StateRank, StateReader
from diloco.comm.hivemind.helper_record import RunHelpers
from diloco.comm.hivemind.state_download import streamed_state
from diloco.comm.hivemind.state_offers import Offer, priority
from diloco.comm.hivemind.state_serving import serialize_state

logger = logging.getLogger(__name__)

WANTED_TTL_S = 15.0  # a request lives this long unless asked again (the asker asks every ASK_EVERY_S)
ASK_EVERY_S = 5.0
POLL_S = 1.0  # how often a client reads the requests
Published = tuple[int, StateRank, StateReader]  # a worker's state: after which round, its rank, its reader


def wanted_key(run_id: str) -> str:
    return f"{run_id}.state_wanted"


def upload_handler(run_id: str) -> str:
    return f"{run_id}.state_upload"


@dataclass(frozen=True)
class Wanted:
    """A worker's request: a state after round ``round`` that ranks above ``rank``, or (``newer``)
    after any later round."""

    round: int
    rank: StateRank
    newer: bool = False

    def served_by(self, offer: Offer) -> bool:
        offered_round, rank = offer
        return (self.newer and offered_round > self.round) or (offered_round == self.round and rank > self.rank)


class StateWants:
    """The run's requests for a state, in the DHT under ``wanted_key`` (subkey: the asker's peer id).
    ``call(fn)`` is a bounded DHT request (``peer.bounded_dht_call``)."""

    def __init__(self, call: Callable, run_id: str, own_id: str):
        self._call, self.key, self.own_id = call, wanted_key(run_id), own_id
        self._asked: tuple[Wanted, float] | None = None

    def ask(self, wanted: Wanted) -> None:
        """Declare ``wanted`` (again only after ``ASK_EVERY_S``, unless it changed)."""
        if self._asked and self._asked[0] == wanted and time.monotonic() - self._asked[1] < ASK_EVERY_S:
            return
        if self._store([wanted.round, wanted.rank.peers, wanted.rank.fingerprint, wanted.newer]):
            self._asked = (wanted, time.monotonic())

    def withdraw(self) -> None:
        """Take back our request, if any (we found a state, or gave up): no client uploads for it."""
        if self._asked is not None and self._store([]):  # a later record than the request's, read as none
            self._asked = None

    def _store(self, value: list) -> bool:
        now = get_dht_time()
        try:
            self._call(
                lambda dht: dht.store(
                    self.key, subkey=self.own_id, value=value, expiration_time=now + WANTED_TTL_S, return_future=True
                )
            )
            return True
        except Exception:  # asked again shortly; a request not withdrawn expires
            logger.debug("declaring a state request failed", exc_info=True)
            return False

    def read(self) -> list[Wanted]:
        """The other peers' live requests; none when the DHT did not answer."""
        try:
            entry = self._call(lambda dht: dht.get(self.key, latest=True, return_future=True))
        except Exception:
            logger.debug("reading the state requests failed", exc_info=True)
            return []
        if entry is None or not isinstance(entry.value, dict):
            return []
        wants = []
        for subkey, item in entry.value.items():
            value = getattr(item, "value", None)
            if subkey == self.own_id or not (isinstance(value, list) and len(value) == 4):
                continue
            try:
                wants.append(Wanted(int(value[0]), StateRank(int(value[1]), float(value[2])), bool(value[3])))
            except (TypeError, ValueError):  # whatever a peer put there, it is no request
                continue
        return wants


class RelayedStates:
    """A helper's store: the best state uploaded so far (the newest round, then the best rank).
    ``take`` hands out a state not handed out before, for the helper to offer."""

    def __init__(self):
        self._lock = threading.Lock()
        self._best: tuple[Offer, dict, bytes] | None = None
        self._fresh = False

    def put(self, metadata: dict, blob: bytes) -> bool:
        """Keep this uploaded state if it beats the one held; returns whether it did."""
        rank = StateRank(int(metadata.get("peers", 0)), float(metadata.get("fingerprint", 0.0)))
        offer = (int(metadata.get("round", -1)), rank)
        with self._lock:
            if self._best is not None and priority(*offer) <= priority(*self._best[0]):
                return False
            self._best, self._fresh = (offer, metadata, blob), True
            return True

    def forget(self) -> None:
        """Let go of the state held (the helper offers it no more)."""
        with self._lock:
            self._best, self._fresh = None, False

    def take(self) -> tuple[Offer, dict, bytes] | None:
        with self._lock:
            if not self._fresh:
                return None
            self._fresh = False
            return self._best


def _messages(metadata: dict, state) -> Iterator[averaging_pb2.DownloadData]:
    """An upload's messages, made one at a time as they are sent. ``state`` is the serialized state,
    a writable buffer (a ``BytesIO``'s ``getbuffer()``): it is copied once, into the protobuf the
    parts are cut from, and let go of then (the caller holding no other reference frees it)."""
    tensor = serialize_torch_tensor(torch.frombuffer(state, dtype=torch.uint8))
    del state
    serialized = MSGPackSerializer.dumps(metadata)
    for i, part in enumerate(split_for_streaming(tensor)):
        yield averaging_pb2.DownloadData(tensor_part=part, metadata=serialized if i == 0 else b"")


async def _received(stream: AsyncIterator[averaging_pb2.DownloadData]) -> tuple[dict, bytes]:
    metadata, tensors = await streamed_state(stream)
    if not isinstance(metadata, dict) or len(tensors) != 1:
        raise ValueError("an upload without metadata, or not one serialized state")
    return metadata, tensors[0].numpy().tobytes()


class _LoopThread:
    """A thread running an asyncio loop on which ``main`` runs until ``stop`` is set."""

    def __init__(self, name: str, main: Callable[[threading.Event], object]):
        self.stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(main(self.stop)), name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self.stop.set()
        self._thread.join(timeout=timeout_s)


async def _replica(call: Callable) -> P2P:
    """A client of the peer's p2p daemon on this thread's loop; the daemon's address is asked for
    through ``call`` (the DHT handle is used under its lock, within its bound)."""
    address = call(lambda dht: dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr, return_future=True))
    return await P2P.replicate(address)


async def _until(stop: threading.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.2)


class UploadServer:
    """A helper's end: takes the states clients upload (handler ``upload_handler`` on the daemon of
    the peer that ``call`` reaches, ``peer.bounded_dht_call``) into ``store``, each read within
    ``timeout_s``; ``refuses(peer, round)`` says why an upload must not be kept ("" to keep it)."""

    def __init__(
        self, call: Callable, run_id: str, store: RelayedStates, *, refuses: Callable[[str, int], str], timeout_s: float
    ):
        self._call, self._name, self.store = call, upload_handler(run_id), store
        self._refuses, self.timeout_s = refuses, timeout_s
        self._loop = _LoopThread("diloco-state-relay", self._serve)

    def start(self) -> None:
        self._loop.start()

    def close(self) -> None:
        self._loop.close()

    async def _serve(self, stop: threading.Event) -> None:
        try:
            p2p = await _replica(self._call)
            await p2p.add_protobuf_handler(self._name, self._take, averaging_pb2.DownloadData, stream_input=True)
        except Exception as error:  # the helper still reduces; a worker that asks for a state waits out its bound
            logger.warning("this helper relays no state: %r", error)
            return
        try:
            await _until(stop)
        finally:
            with contextlib.suppress(Exception):  # the daemon may be gone first
                await p2p.remove_protobuf_handler(self._name, stream_input=True)
            await p2p.shutdown()  # this client of the daemon only

    async def _take(self, stream, context: P2PContext) -> averaging_pb2.DownloadRequest:
        peer = context.remote_id.to_base58()
        try:
            metadata, blob = await asyncio.wait_for(_received(stream), timeout=self.timeout_s)
            offered_round = int(metadata.get("round", -1))
            why = self._refuses(peer, offered_round)
            kept = not why and self.store.put(metadata, blob)
        except Exception as error:  # a broken upload is the uploader's problem; the next one may do
            logger.warning("an upload of a state from peer %s failed: %r", peer, error)
            return averaging_pb2.DownloadRequest()
        if why:
            logger.warning("refused a state uploaded by peer %s: %s", peer, why)
        elif kept:
            logger.info(
                "holding the state after round %d uploaded by peer %s (%d bytes) for the run's workers",
                offered_round + 1,
                peer,
                len(blob),
            )
        return averaging_pb2.DownloadRequest()


class StateUploader:
    """A client's end: every ``POLL_S``, while no worker that serves a state has been seen
    (``no_server()``: the run is of clients), it reads the run's requests (``wants``) and, where its
    own state (``published()``: round, rank, reader; None before its first round) would serve one
    that no offer serves yet (``offers()``: (round, rank) of each, the helpers' included), uploads
    it to a live helper (``helpers.ids()``) through the daemon of the peer that ``call``
    reaches, within ``timeout_s``: each state once, to the next helper if an upload failed."""

    def __init__(
        self,
        call: Callable,
        run_id: str,
        *,
        wants: StateWants,
        offers: Callable[[], list[Offer]],
        published: Callable[[], Published | None],
        helpers: RunHelpers,
        no_server: Callable[[], bool],
        timeout_s: float,
    ):
        self._call, self._name = call, upload_handler(run_id)
        self._wants, self._offers, self._published, self._helpers = wants, offers, published, helpers
        self._no_server, self.timeout_s = no_server, timeout_s
        self._sent: dict[float, float] = {}  # priority -> when, of the states uploaded: each goes up once
        self._failed: set[tuple[float, str]] = set()  # (priority, helper) of the uploads that failed
        self._loop = _LoopThread("diloco-state-upload", self._run)

    def start(self) -> None:
        self._loop.start()

    def close(self) -> None:
        self._loop.close()

    def due(self) -> tuple[Published, str] | None:
        """Our state and the helper to upload it to, if a request wants it and no offer serves it yet."""
        published = self._published()
        if published is None or not self._no_server():
            return None
        offered_round, rank, _ = published
        ours = (offered_round, rank)
        served = [wanted for wanted in self._wants.read() if wanted.served_by(ours)]
        if not served:
            return None
        offers = self._offers()
        if all(any(wanted.served_by(offer) for offer in offers) for wanted in served):
            return None  # a helper (or a peer that serves) already offers what they want
        now = time.monotonic()
        self._sent = {sent: at for sent, at in self._sent.items() if now - at < WANTED_TTL_S}
        if priority(*ours) in self._sent:  # the helper's offer may not show yet
            return None
        helpers = [helper for helper in self._helpers.ids() if (priority(*ours), helper) not in self._failed]
        return (published, helpers[0]) if helpers else None

    async def _run(self, stop: threading.Event) -> None:
        p2p = None
        try:
            while not stop.is_set():
                await asyncio.sleep(POLL_S)
                try:
                    due = self.due()
                    if due is None:
                        continue
                    p2p = p2p or await _replica(self._call)
                    await asyncio.wait_for(self._upload(p2p, *due), timeout=self.timeout_s)
                except Exception as error:  # the asker asks again; the next poll may do
                    logger.warning("uploading our state to a helper failed: %r", error)
        finally:
            if p2p is not None:
                await p2p.shutdown()  # this client of the daemon only

    async def _upload(self, p2p, published: Published, helper: str) -> None:
        offered_round, rank, read = published
        serialized = read(serialize_state)
        if serialized is None:  # an outer step changed it since: the next poll sees the new one
            return
        metadata = {"round": offered_round, "peers": rank.peers, "fingerprint": rank.fingerprint}
        messages = _messages(metadata, serialized.getbuffer())
        del serialized  # the messages hold the one reference left: one copy of the state while it is sent
        started, key = time.monotonic(), priority(offered_round, rank)
        try:
            await p2p.call_protobuf_handler(
                PeerID.from_base58(helper), self._name, iter_as_aiter(messages), averaging_pb2.DownloadRequest
            )
        except BaseException:  # the next poll tries the next helper
            self._failed.add((key, helper))
            raise
        self._sent[key] = time.monotonic()
        logger.info(
            "uploaded our state after round %d to helper %s for a peer that asked (%.2f s)",
            offered_round + 1,
            helper,
            time.monotonic() - started,
        )
