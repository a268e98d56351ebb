"""A bulk data plane beside hivemind: a round's fp32 average through a gloo ring all-reduce.

hivemind does what it is good at: it finds the round's group (matchmaking under the round's key,
the run key, the roster) and gathers what every peer declares. It is slow at moving hundreds of
megabytes, though (every part passes through protobuf messages, the p2p daemon and an asyncio
executor): at 85M parameters on loopback a round's all-reduce takes seconds where
``torch.distributed``'s gloo takes a fraction of one. With ``comm.hivemind.data_plane=gloo`` each
worker that can be dialled declares an endpoint (``DataPlane.declaration``) in the matchmaking's
gathered data; when every peer of a group declared one and the codec is lossless
(``carries``), the averager skips its own all-reduce and the workers average their vectors
through a gloo process group formed for that group alone (as torchft re-forms its process
groups per quorum), with a rendezvous at the first peer's store under a name made from every
peer's nonce. Otherwise (a client behind NAT, a peer without the plane, a lossy codec) the
group averages through hivemind as always, so a run mixes both freely.

What stays as it is: every peer computes the same screening from the same declared norms
(robust.py) and scales its own vector by it; the ring all-reduce reduces each chunk once, so
every peer ends with the same bytes; a peer that fails inside it fails the round of the group
(the survivors retry among themselves through hivemind, as after any broken all-reduce). What
differs: the bytes are counted as a ring all-reduce moves them (2 (n-1)/n of the payload each
way), not read off the wire; and a peer's declared norm is trusted (gloo sums what it is sent),
so the plane is for sites whose peers trust each other, like ``comm.backend=torchdist``.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import secrets
from collections.abc import Mapping, Sequence

import torch

from diloco.compression import Codec

logger = logging.getLogger(__name__)

_ENDPOINT, _NONCE = "plane", "nonce"
_ARRIVED = "arrived/"  # a round's rendezvous: each peer's key under the group's prefix
_GIVE_UP_AFTER = 2  # failures in a row after which this worker stops declaring its endpoint


def carries(codec: Codec, gathered: Sequence[Mapping]) -> bool:
    """Whether a group whose peers gathered ``gathered`` averages over the plane: every peer
    declared an endpoint and the codec is lossless. Every peer of the group decides alike."""
    return codec.lossless and len(gathered) > 1 and all(isinstance(g, Mapping) and g.get(_ENDPOINT) for g in gathered)


def ring_bytes(numel: int, peers: int) -> int:
    """Bytes a ring all-reduce of ``numel`` fp32 values sends (and receives) per peer."""
    return 2 * (peers - 1) * 4 * numel // peers


class DataPlane:
    """One worker's end of the plane: the store where a group it leads meets, and the all-reduce.

    ``host`` is the address the other peers dial (and where gloo listens for them);
    ``start_timeout_s`` bounds starting the store, ``connect_timeout_s`` a round's rendezvous,
    ``timeout_s`` the all-reduce itself.
    """

    def __init__(self, host: str, *, start_timeout_s: float, connect_timeout_s: float, timeout_s: float):
        from torch.distributed import TCPStore

        self.host = host
        self._connect = datetime.timedelta(seconds=connect_timeout_s)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        # the first connection of a process looks its own address up in the DNS, which takes 10 s
        # where no name server answers (a network namespace): hence a bound of its own
        self._store = TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=start_timeout_s),
        )
        self._store.set_timeout(self._connect)
        self.endpoint = f"{host}:{self._store.port}"
        self._failures = 0

    @property
    def active(self) -> bool:
        """False once the plane failed ``_GIVE_UP_AFTER`` rounds in a row (its ports are likely
        unreachable): the worker averages through hivemind for the rest of the run."""
        return self._failures < _GIVE_UP_AFTER

    def declaration(self) -> dict:
        """What this worker adds to a round's gathered data: its endpoint and a fresh nonce."""
        return {_ENDPOINT: self.endpoint, _NONCE: secrets.token_hex(16)} if self.active else {}

    def all_reduce_sum(self, flat: torch.Tensor, gathered: Mapping, own) -> None:
        """Sum ``flat`` (contiguous fp32) in place over the group whose peers gathered
        ``gathered`` (peer -> data, in the group's order, ``own`` among them). Raises on any failure
        (a peer gone, a timeout): ``flat`` then holds no meaningful values."""
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        peers = list(gathered)
        declared = [gathered[p] for p in peers]
        rank = peers.index(own)
        name = hashlib.sha256("".join(str(d.get(_NONCE, "")) for d in declared).encode()).hexdigest()[:32]
        try:
            leader_host, leader_port = str(declared[0][_ENDPOINT]).rsplit(":", 1)
            store = PrefixStore(
                name,
                self._store
                if rank == 0
                else TCPStore(leader_host, int(leader_port), is_master=False, timeout=self._connect),
            )
            # the group's rendezvous first: hivemind gathered every peer a moment ago, so one that is
            # not there within the connect bound never comes (a follower that gave up on the group
            # its leader counted it in): the round fails then, not after the whole deadline
            store.set(f"{_ARRIVED}{rank}", "1")
            store.wait([f"{_ARRIVED}{i}" for i in range(len(peers))], self._connect)
            options = ProcessGroupGloo._Options()
            options._timeout = self._timeout  # the all-reduce: the deadline
            options._devices = [ProcessGroupGloo.create_device(hostname=self.host)]
            group = ProcessGroupGloo(store, rank, len(peers), options)
            try:
                group.allreduce([flat]).wait()
            finally:
                del group
        except Exception:
            self._failures += 1
            if not self.active:
                logger.warning(
                    "the gloo data plane failed %d rounds in a row: averaging through hivemind from now on",
                    self._failures,
                )
            raise
        self._failures = 0

    def close(self) -> None:
        self._store = None


def plane_host(listen_host: str, announce_host: str, visible: Sequence[str]) -> str:
    """The address other peers dial to reach this worker's plane: the announced one, else the
    one it listens on, else (listening on every address) the first non-loopback IPv4 address its
    hivemind peer is visible at, else loopback."""
    if announce_host:
        return announce_host
    if listen_host not in ("0.0.0.0", "::", ""):
        return listen_host
    for address in visible:
        parts = address.split("/")
        if len(parts) > 2 and parts[1] == "ip4" and not parts[2].startswith("127."):
            return parts[2]
    return "127.0.0.1"
