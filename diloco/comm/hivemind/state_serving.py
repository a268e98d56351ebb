"""Our state served to the peers that download it, from the averager (``averager.ExactAverager``).

The worker offers its state (``share_state``: metadata and a reader that reads it under the outer
step's lock); nothing is read or serialized until a peer asks. A peer downloads it in parts from
several peers at once (``state_download.py``): we serve the manifest of our live state and the parts
asked of it (``rpc_download_state_part``); or whole, as hivemind serves a state
(``get_current_state``, hivemind's ``rpc_download_state``). In a keyed run each request must
prove that its sender holds the run key (``state_access.py``). Requests arrive in the averager's
process and are answered in the host process, which holds the state: a thread there answers
what the averager's process asks through a pipe. A stale offer (an outer step changed the state
since) answers nothing.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import threading
import typing
import weakref
from multiprocessing.reduction import ForkingPickler

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.serializer import MSGPackSerializer

from diloco.comm.base import StateReader
from diloco.comm.hivemind.state_access import StateAccess
from diloco.comm.hivemind.state_parts import Manifest, byte_views, flatten, manifest_of, read_range

logger = logging.getLogger(__name__)


class StateServing:
    """A mix-in of the averager: the state it offers, served whole or in parts, to the peers
    ``access`` admits (a ``StateAccess``, set by the averager)."""

    access: StateAccess

    def share_state(self, metadata: dict, state: StateReader, *, priority: float) -> None:
        """Serve the state ``state`` reads (with ``metadata``) to peers that download state; peers
        try the highest ``priority`` first. It is read and serialized only when a peer asks, under
        the outer step's lock; once stale (an outer step changed it) nothing is served until the
        next offer. Replaces the previous one atomically."""
        self._shared_state = (metadata, state)
        self.state_sharing_priority = priority

    def get_current_state(self):
        # called in this (the host) process, on a thread of hivemind's, when a peer downloads our state
        if self._shared_state is None:
            return {}, [], None
        metadata, read = self._shared_state
        serialized = read(serialize_state)
        if serialized is None:  # an outer step changed the state since it was offered
            return {}, [], None
        return metadata, [torch.frombuffer(serialized.getbuffer(), dtype=torch.uint8)], None

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # typing's: hivemind reads the handler's kind from them
        """hivemind's, for a requester ``access`` admits: the proof rides in the request's metadata,
        so the request is a ``DownloadData`` (hivemind's own, an empty ``DownloadRequest``, reads
        as one without a proof). A refused request raises ``StateRefused``: hivemind hands its
        message to the requester."""
        if not self.allow_state_sharing:
            return
        self.access.check(_asked(request), requester=context.remote_id, server=self.peer_id)
        async for message in super().rpc_download_state(request, context):
            yield message

    async def rpc_download_state_part(
        self, request: averaging_pb2.DownloadData, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # typing's: hivemind reads the handler's kind from them
        """The manifest of the state we offer ({"manifest": true} in the request's metadata, MSGPack),
        or its parts ``first`` to ``stop`` of the manifest ``digest``, one message each, for a
        requester ``access`` admits. Nothing where we offer none, or the offer is stale (or of
        another manifest)."""
        if not self.allow_state_sharing:
            return
        asked = _asked(request)
        if asked is None:  # not a request of ours
            return
        self.access.check(asked, requester=context.remote_id, server=self.peer_id)
        future = MPFuture()
        self._part_pipe[0].send((asked, future))
        answer = await future
        if isinstance(answer, dict):
            yield averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(answer))
        elif isinstance(answer, tuple):
            part_bytes, data = answer
            for i, start in enumerate(range(0, len(data), part_bytes)):
                part = runtime_pb2.Tensor(buffer=data[start : start + part_bytes])
                yield averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(asked["first"] + i), tensor_part=part)

    def _serve_parts(self) -> None:
        """Start answering, in this (the host) process, what ``rpc_download_state_part`` asks in the
        averager's: call before the averager's process starts."""
        self._shared_state: tuple[dict, StateReader] | None = None
        self._part_pipe = mp.Pipe(duplex=True)
        self._manifest_cache: tuple[object, Manifest | None] | None = None
        thread = threading.Thread(target=_answer_parts, args=(self._part_pipe[1], weakref.ref(self)), daemon=True)
        thread.start()

    def _answer_part_request(self, asked: dict):
        """What ``rpc_download_state_part`` sends for ``asked``: {"metadata", "manifest"}, (part
        bytes, the parts' bytes), or None."""
        shared = self._shared_state
        if shared is None:
            return None
        metadata, read = shared
        if self._manifest_cache is None or self._manifest_cache[0] is not shared:
            manifest = read(manifest_of)  # None once stale; a relayed state (bytes) has none
            self._manifest_cache = (shared, manifest if isinstance(manifest, Manifest) else None)
        manifest = self._manifest_cache[1]
        if manifest is None:
            return None
        if asked.get("manifest"):
            return {"metadata": MSGPackSerializer.dumps(metadata), "manifest": manifest.to_wire()}
        first, stop = asked.get("first"), asked.get("stop")
        if asked.get("digest") != manifest.digest() or not (isinstance(first, int) and isinstance(stop, int)):
            return None
        if not 0 <= first < stop <= manifest.parts:
            return None
        start, end = manifest.span(first)[0], manifest.span(stop - 1)[1]
        data = read(lambda state: read_range(byte_views(flatten(state)[1]), start, end))
        return (manifest.part_bytes, data) if isinstance(data, bytes) else None


def _asked(request: averaging_pb2.DownloadData) -> dict | None:
    """A state request's metadata (a dict, {} where it has none), or None where it is not one of ours."""
    if not request.metadata:
        return {}
    try:
        asked = MSGPackSerializer.loads(request.metadata)
    except Exception:
        return None
    return asked if isinstance(asked, dict) else None


def _answer_parts(pipe, owner: weakref.ref) -> None:
    """The host process's thread that answers the part requests of the averager's process, while
    the averager lives."""
    while owner() is not None:
        try:
            if not pipe.poll(1.0):
                continue
            request = pipe.recv_bytes()
        except (EOFError, OSError):  # the averager's process has ended
            return
        try:
            asked, future = ForkingPickler.loads(request)
        except Exception as error:  # its asker ended while sending it (as at Ctrl-C): nothing to answer
            logger.debug("a part request could not be read: %r", error)
            continue
        averager = owner()
        try:
            future.set_result(averager._answer_part_request(asked) if averager is not None else None)
        except Exception as error:  # a request we cannot answer: nothing is sent
            logger.warning("serving parts of our state failed: %r", error)
            future.set_result(None)
        del averager


def serialize_state(state: dict) -> io.BytesIO:
    """A worker's state as ``torch.save`` writes it: what a peer that downloads it receives."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer
