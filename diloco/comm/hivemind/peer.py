"""A worker's hivemind peer: its DHT process, how it is reached, and bounded calls to it.

``start_dht`` starts a DHT peer as ``comm.hivemind.*`` says and turns p2pd's one error type into the user's
mistake; ``bounded_dht_call`` makes every DHT request wait a bounded time; ``Peer`` is a worker's
own peer, which with ``comm.hivemind.client_mode=auto`` starts as a client, asks the run's peers to
dial it back and starts again as a full peer when they could (``reachability.py``).
``roster_reader`` and ``probe_roster`` are the short-lived peers that ``diloco status`` and
``diloco join`` read the run's roster with.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

from diloco.comm.base import CommError
from diloco.comm.bounds import control_limit_s
from diloco.comm.config import CommConfig
from diloco.comm.hivemind import reachability
from diloco.comm.hivemind.roster import RosterReader
from diloco.comm.hivemind.roster_records import RosterEntry
from diloco.comm.hivemind.run_key import RunKeyValidator
from diloco.comm.hivemind.settings import HivemindConfig
from diloco.comm.run_key_env import resolve_run_key

logger = logging.getLogger(__name__)

_PORT_FREED_S = 5.0  # how long a peer started again waits for the port its previous p2pd held


class PortInUse(CommError):
    """``comm.hivemind.port`` is held by another process."""


def own_maddrs(cfg: HivemindConfig) -> list[str]:
    """The addresses a peer started with ``cfg`` listens at and announces: ``comm.hivemind.announce_host``
    counts only with a fixed ``comm.hivemind.port``."""
    announced = [f"/ip4/{cfg.announce_host}/tcp/{cfg.port}"] if cfg.announce_host and cfg.port else []
    return [f"/ip4/{cfg.host}/tcp/{cfg.port}", *announced]


def start_dht(
    cfg: HivemindConfig,
    *,
    run_key: str = "",
    initial_peers: Sequence[str] | None = None,
    client_mode: bool | None = None,
):
    """Start a DHT peer listening as ``cfg`` says (the bootstrap peer uses this too), its records
    signed with ``run_key`` (``comm.run_key``; "" = ``$DILOCO_RUN_KEY``, if set); ``client_mode``:
    dial out only (default: ``comm.hivemind.client_mode=true``)."""
    from diloco.comm.hivemind.owned_dht import OwnedDHT

    peers = list(cfg.initial_peers if initial_peers is None else initial_peers)
    listen, *announce = own_maddrs(cfg)
    run_key = resolve_run_key(run_key)
    try:
        return OwnedDHT(
            initial_peers=peers,
            host_maddrs=[listen],
            announce_maddrs=announce or None,
            client_mode=cfg.client_mode == "true" if client_mode is None else client_mode,
            use_relay=cfg.use_relay,
            use_auto_relay=cfg.use_auto_relay,
            record_validators=[RunKeyValidator(run_key)] if run_key else [],
            start=True,
            startup_timeout=cfg.startup_timeout_s,
        )
    except Exception as error:  # p2pd reports everything as one error type: tell the user which mistake
        if "address already in use" in str(error):
            raise PortInUse(
                f"comm.hivemind.port={cfg.port} is already in use on {cfg.host}; pick another, or "
                "comm.hivemind.port=0 for any free port"
            ) from None
        raise CommError(_explain_start_failure(str(error), cfg, peers)) from None


def _explain_start_failure(message: str, cfg: HivemindConfig, peers: list[str]) -> str:
    if "bootstrap peers" in message or "initial" in message:
        return (
            f"could not reach any of comm.hivemind.initial_peers ({', '.join(peers)}): check the address, that the "
            f"peer is running, and that its port is open"
        )
    if "multiaddr" in message.lower() or "invalid" in message.lower():
        return f"comm.hivemind.initial_peers or comm.hivemind.host is not a valid address: {message.splitlines()[0]}"
    return f"the hivemind peer did not start: {message.strip().splitlines()[-1]}"


def bounded_dht_call(dht, lock: threading.Lock, *, timeout_s: float) -> Callable:
    """``call(fn)``: sends ``fn(dht)``, a DHT request made with ``return_future=True``, under ``lock``
    (hivemind's DHT handle is not safe to use from two threads at once) and waits at most
    ``timeout_s`` for its answer, outside the lock; raises ``TimeoutError`` past it."""

    def call(fn):
        with lock:
            future = fn(dht)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the DHT did not answer within {timeout_s:g} s") from None

    return call


def visible_addresses(dht) -> list[str]:
    return [str(address) for address in dht.get_visible_maddrs()]


@contextlib.contextmanager
def roster_reader(cfg: CommConfig):
    """A short-lived peer that reads the roster of run ``cfg.run_id`` through ``cfg.hivemind.initial_peers``:
    yields a function returning the live workers' entries by index (``diloco status`` calls it
    again and again). A peer without the run's key reads nothing. It only reads: a client on any free
    port, which works behind NAT too."""
    dht = start_dht(dataclasses.replace(cfg.hivemind, port=0), run_key=cfg.run_key, client_mode=True)
    try:
        dht_call = bounded_dht_call(dht, threading.Lock(), timeout_s=control_limit_s(cfg.hivemind.request_timeout_s))
        yield RosterReader(dht_call, run_id=cfg.run_id, worker_index=-1, planned=0).entries
    finally:
        dht.shutdown()


def probe_roster(cfg: CommConfig, *, timeout_s: float = 10.0) -> dict[int, RosterEntry]:
    """The live workers of run ``cfg.run_id`` (a newcomer picks its slot from them); empty when
    none answers within ``timeout_s``, which is also what a peer without the run's key sees."""
    with roster_reader(cfg) as read:
        return first_entries(read, timeout_s)


def first_entries(read: Callable[[], dict[int, RosterEntry]], timeout_s: float) -> dict[int, RosterEntry]:
    """``read()`` again until it finds workers or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            entries = read()
        except TimeoutError:  # one read the DHT did not answer in time: ask again while time is left
            entries = {}
        if entries or time.monotonic() > deadline:
            return entries
        time.sleep(0.5)  # the DHT may need a moment to find the record's holders


class Peer:
    """A worker's DHT peer. ``dht`` is hivemind's handle (the averagers run on it); ``call(fn)`` is
    a bounded request to it (``bounded_dht_call``); ``client_mode``: it dials out only, so it reduces
    no part and serves no state. With ``comm.hivemind.client_mode=auto`` a joiner starts as a client
    and starts again as a full peer unless the run's peers could not dial it back (``reachability.py``).
    ``run_key``: ``comm.run_key``; ``start``: how a DHT peer is started (``start_dht``)."""

    def __init__(self, cfg: HivemindConfig, *, run_key: str, start: Callable = start_dht):
        self.cfg, self._run_key, self._start_dht = cfg, run_key, start
        self.control_s = control_limit_s(cfg.request_timeout_s)
        mode = reachability.first_mode(
            cfg.client_mode, own_maddrs=own_maddrs(cfg), initial_peers=list(cfg.initial_peers)
        )
        if mode == reachability.LOOPBACK_CLIENT:
            self._say_loopback_client()
        self._client_mode = mode != reachability.SERVER
        self._start(port=cfg.port)
        self._dialbacks: dict[str, float] = {}  # requests answered: peer -> request time
        if mode == reachability.ASK:
            self._choose_mode()

    @property
    def client_mode(self) -> bool:
        """Set for good once the peer has started (``comm.hivemind.client_mode=auto`` decides it then)."""
        return self._client_mode

    def _start(self, *, port: int) -> None:
        cfg = dataclasses.replace(self.cfg, port=port)
        self.dht = self._start_dht(cfg, run_key=self._run_key, client_mode=self._client_mode)
        self._lock = threading.Lock()
        self.call = bounded_dht_call(self.dht, self._lock, timeout_s=self.control_s)

    def send(self, fn):
        """``fn(dht)``, a DHT request made with ``return_future=True``, sent without waiting for its
        answer: its future (``call`` waits a bounded time instead)."""
        with self._lock:
            return fn(self.dht)

    @property
    def peer_id(self):
        return self.dht.peer_id

    @property
    def visible_addresses(self) -> list[str]:
        return visible_addresses(self.dht)

    @property
    def addresses(self) -> list[str]:
        """Where a newcomer joins the run through us: a client cannot be dialled, so the peers it joined through."""
        return list(self.cfg.initial_peers) if self.client_mode else self.visible_addresses

    def _say_loopback_client(self) -> None:
        logger.warning(
            "listening on loopback only (comm.hivemind.host=%s) while the run is at other addresses: joining as "
            "a client: it sends its contribution, reduces no part, serves no state (set "
            "comm.hivemind.host=0.0.0.0 to take a full part)",
            self.cfg.host,
        )

    def _choose_mode(self) -> None:
        """``comm.hivemind.client_mode=auto``, started as a client that still listens on its port: ask
        the run's peers to dial that port back (reachability.py). A client is never in another peer's
        routing table, so no peer's DHT request waits on an address that may not answer meanwhile.
        Dialled back, or nobody answered, or nothing to dial in a run that could not dial it either:
        start again as a full peer, on the same port; not dialled back: stay a client."""
        visible = self.visible_addresses
        addresses = reachability.dialable_addresses(visible)
        if not addresses and reachability.listens_where_the_run_cannot_dial(visible, self.cfg.initial_peers):
            self._say_loopback_client()
            return
        if addresses:
            timeout_s = 2 * self.cfg.heartbeat_s + reachability.DIAL_TIMEOUT_S * len(addresses) + self.control_s
            try:
                verdict = reachability.ask(self.call, str(self.peer_id), addresses, timeout_s=timeout_s)
            except Exception:  # the DHT did not take the request: as if nobody answered
                logger.debug("reachability request failed", exc_info=True)
                verdict = None
            where = ", ".join(f"{host}:{port}" for host, port in addresses)
            if verdict is None:
                logger.warning("no peer answered the reachability check within %.0f s: joining as reachable", timeout_s)
            elif verdict:
                logger.info("reachable at %s", where)
            else:
                logger.warning(
                    "not reachable from outside at %s: joining as a client: it sends its contribution, reduces no "
                    "part, serves no state (forward a port and set comm.hivemind.announce_host to take a full part)",
                    where,
                )
                return
        self._become_full_peer(port=self.cfg.port or (addresses[0][1] if addresses else 0))

    def _become_full_peer(self, *, port: int) -> None:
        """Our peer started again as a full peer on ``port``, the one dialled back, once the
        previous p2pd let go of it (at most ``_PORT_FREED_S``); with ``comm.hivemind.port=0``, on any
        free port if another process took it meanwhile."""
        self.dht.shutdown()
        self._client_mode = False
        deadline = time.monotonic() + _PORT_FREED_S
        while True:
            try:
                self._start(port=port)
                return
            except PortInUse:
                if port and not self.cfg.port:
                    port = 0  # any free one: the address announced is the one it listens at
                elif time.monotonic() > deadline:
                    raise
                else:
                    time.sleep(0.2)  # the previous p2pd is exiting (it was sent SIGTERM)

    def answer_dialbacks(self) -> None:
        """Dial back the peers that asked whether they are reachable (on the roster heartbeat's thread)."""
        reachability.answer(self.call, own_peer_id=str(self.peer_id), answered=self._dialbacks)

    def shutdown(self) -> None:
        self.dht.shutdown()
