"""Averaging over hivemind: a DHT to find the run's peers, a butterfly all-reduce to average.

Each round is matched under its own DHT key (run id + round number), so a worker that is a
round behind never averages with the others' newer pseudo-gradients. Rounds wait up to
``comm.matchmaking_s`` for the group the roster expects (``roster.py``: the planned workers
minus those seen gone, plus those that joined) and start at once when it is full. A round whose
group broke (a peer crashed inside the all-reduce) is tried once more among the survivors, under
a key of its own, while its deadline lasts. With a run key (``run_key.py``) only key holders
can write the run's DHT records or join its groups.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from diloco.comm.base import (
    CommBackend,
    CommConfig,
    CommError,
    Contribution,
    PeerState,
    StateRank,
    StateReader,
    SyncResult,
    average_payloads,
)
from diloco.comm.bounds import control_limit_s, round_limit_s
from diloco.comm.hivemind import gloo_plane, reachability
from diloco.comm.hivemind.gloo_plane import DataPlane, plane_host
from diloco.comm.hivemind.roster import HEARTBEAT_S, Roster, RosterEntry
from diloco.comm.hivemind.run_key import RunKeyValidator, resolve_run_key
from diloco.comm.link_meter import LinkMeter
from diloco.comm.robust import declared_norm, norm_of, screen
from diloco.compression import Codec, all_finite

logger = logging.getLogger(__name__)

_ROUND_BITS = 16  # rounds are keyed modulo 2**16 on the DHT: far more than any peer can lag
_POLL_S = 1.0  # how often a worker waiting for a group checks whether the others went ahead


def round_group_bits(round_index: int, attempt: int = 0) -> str:
    """The hivemind group bits that key a round's matchmaking on the DHT (a retry gets its own key)."""
    return format(round_index % (1 << _ROUND_BITS), f"0{_ROUND_BITS}b") + "1" * attempt


def start_dht(cfg: CommConfig, *, initial_peers: Sequence[str] | None = None, client_mode: bool | None = None):
    """Start a DHT peer listening as ``cfg`` says (the bootstrap peer uses this too); ``client_mode``:
    dial out only (default: ``comm.client_mode=true``)."""
    from diloco.comm.hivemind.owned_dht import OwnedDHT

    peers = list(cfg.initial_peers if initial_peers is None else initial_peers)
    announce = [f"/ip4/{cfg.announce_host}/tcp/{cfg.port}"] if cfg.announce_host and cfg.port else None
    run_key = resolve_run_key(cfg.run_key)
    try:
        return OwnedDHT(
            initial_peers=peers,
            host_maddrs=[f"/ip4/{cfg.host}/tcp/{cfg.port}"],
            announce_maddrs=announce,
            client_mode=cfg.client_mode == "true" if client_mode is None else client_mode,
            use_relay=cfg.use_relay,
            use_auto_relay=cfg.use_auto_relay,
            record_validators=[RunKeyValidator(run_key)] if run_key else [],
            start=True,
            startup_timeout=cfg.startup_timeout_s,
        )
    except Exception as error:  # p2pd reports everything as one error type: tell the user which mistake
        raise CommError(_explain_start_failure(str(error), cfg, peers)) from None


def _explain_start_failure(message: str, cfg: CommConfig, peers: list[str]) -> str:
    if "address already in use" in message:
        return f"comm.port={cfg.port} is already in use on {cfg.host}; pick another, or comm.port=0 for any free port"
    if "bootstrap peers" in message or "initial" in message:
        return (
            f"could not reach any of comm.initial_peers ({', '.join(peers)}): check the address, that the "
            f"peer is running, and that its port is open"
        )
    if "multiaddr" in message.lower() or "invalid" in message.lower():
        return f"comm.initial_peers or comm.host is not a valid address: {message.splitlines()[0]}"
    return f"the hivemind peer did not start: {message.strip().splitlines()[-1]}"


def _priority(round_index: int, rank: StateRank) -> float:
    """A state's download priority (hivemind serves the highest first): round, then peers, then
    fingerprint, packed into one float (exact: fewer than 53 bits in all)."""
    return round_index * 1000.0 + rank.peers + round(rank.fingerprint * (1 << 24)) / (1 << 24) * 0.99


def _offer(priority: float) -> tuple[int, StateRank]:
    round_index, rest = divmod(priority, 1000.0)
    peers = int(rest)
    return int(round_index), StateRank(peers, round((rest - peers) / 0.99 * (1 << 24)) / (1 << 24))


def _same_offer(a: tuple[int, StateRank], b: tuple[int, StateRank]) -> bool:
    """Whether two (round, rank) are one offer as the DHT carries it (the fingerprint to 24 bits)."""
    return _priority(*a) == _priority(*b)


@contextlib.contextmanager
def roster_reader(cfg: CommConfig):
    """A short-lived peer that reads the roster of run ``cfg.run_id`` through ``cfg.initial_peers``:
    yields a function returning the live workers' entries by index (``diloco status`` calls it
    again and again). A peer without the run's key reads nothing. It only reads: a client on any free
    port, which works behind NAT too."""
    dht = start_dht(dataclasses.replace(cfg, port=0), client_mode=True)
    try:
        dht_call = bounded_dht_call(dht, threading.Lock(), timeout_s=control_limit_s(cfg.request_timeout_s))
        yield Roster(dht_call, run_id=cfg.run_id, worker_index=-1, planned=0).entries
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


class HivemindBackend(CommBackend):
    """One worker's DHT peer, averager and roster record. ``templates`` fix the shapes of what is
    averaged; ``fragments`` (lists of indices into ``templates``) get one averager each, so that
    streaming can average one fragment while another trains (default: one fragment of everything).
    ``num_workers`` is the planned size of the run; ``worker_index`` keys this worker's roster record."""

    averages_in_background = True  # the averager process does the work

    def __init__(
        self,
        cfg: CommConfig,
        *,
        templates: Sequence[torch.Tensor],
        num_workers: int,
        codec: Codec,
        fragments: Sequence[Sequence[int]] | None = None,
        worker_index: int = 0,
        slots: int = 0,
    ):
        self.cfg, self.codec = cfg, codec
        self.num_workers = num_workers
        self._closed = False
        self._averagers = []
        self._busy: list[threading.Lock] = []  # held while a fragment's average runs
        self._control_s = control_limit_s(cfg.request_timeout_s)
        self.client_mode = cfg.client_mode == "true"
        self._dht = start_dht(cfg, client_mode=self.client_mode)
        self._dht_call = bounded_dht_call(self._dht, threading.Lock(), timeout_s=self._control_s)
        if cfg.client_mode == "auto":
            self._choose_mode()
        self._plane = self._start_plane()
        self._flats: list[torch.Tensor] = []  # each fragment's averaged tensors, as one flat buffer
        self._dialbacks: dict[str, float] = {}  # requests answered: peer -> request time
        fragments = fragments or [range(len(templates))]
        self.roster = Roster(
            self._dht_call,
            run_id=cfg.run_id,
            worker_index=worker_index,
            planned=num_workers,
            slots=slots,
            serves_state=not self.client_mode,
            on_beat=None if self.client_mode else self._answer_dialbacks,
        )
        try:
            for fragment, indices in enumerate(fragments):
                self._averagers.append(self._start_averager([templates[i] for i in indices], fragment))
                self._busy.append(threading.Lock())
            self.roster.start()
        except BaseException:
            self.shutdown()
            raise
        self._published: tuple[int, int] | None = None  # (round, peers) of the state we offer
        # compression.name=adaptive: the link's measure, and when the last round ended (compute since)
        self._meter = LinkMeter(codec) if codec.chosen_per_round else None
        self._last_round_end = time.monotonic()
        self._was_alone = False
        self._said_unreachable_run = False

    def _choose_mode(self) -> None:
        """``comm.client_mode=auto``: ask the run's peers to dial us back (reachability.py); if they
        cannot, restart our peer in client mode. One that listens on loopback only in a run at other
        addresses is a client at once (nobody there can dial it); one that starts a run, or joins a
        run on loopback, is whatever it is: nobody else could tell."""
        visible = visible_addresses(self._dht)
        addresses = reachability.dialable_addresses(visible)
        if self.cfg.initial_peers and reachability.listens_where_the_run_cannot_dial(visible, self.cfg.initial_peers):
            logger.warning(
                "listening on loopback only (comm.host=%s) while the run is at other addresses: joining as a "
                "client: it sends its contribution, reduces no part, serves no state (set comm.host=0.0.0.0 "
                "to take a full part)",
                self.cfg.host,
            )
            self._become_client()
            return
        if not self.cfg.initial_peers or not addresses:
            return
        timeout_s = 2 * HEARTBEAT_S + reachability.DIAL_TIMEOUT_S * len(addresses) + self._control_s
        try:
            verdict = reachability.ask(self._dht_call, str(self._dht.peer_id), addresses, timeout_s=timeout_s)
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
                "not reachable from outside at %s: joining as a client: it sends its contribution, reduces no part, "
                "serves no state (forward a port and set comm.announce_host to take a full part)",
                where,
            )
            self._become_client()

    def _become_client(self) -> None:
        """Our peer restarted in client mode: it dials out only."""
        self._dht.shutdown()
        self.client_mode = True
        self._dht = start_dht(self.cfg, client_mode=True)
        self._dht_call = bounded_dht_call(self._dht, threading.Lock(), timeout_s=self._control_s)

    def _answer_dialbacks(self) -> None:
        """Dial back the peers that asked whether they are reachable (on the heartbeat's thread)."""
        reachability.answer(self._dht_call, own_peer_id=str(self._dht.peer_id), answered=self._dialbacks)

    def _start_plane(self) -> DataPlane | None:
        """``comm.data_plane=gloo``: this worker's end of the plane, unless nobody can dial it."""
        if self.cfg.data_plane != "gloo" or self.client_mode:
            return None
        host = plane_host(self.cfg.host, self.cfg.announce_host, visible_addresses(self._dht))
        try:
            return DataPlane(
                host,
                start_timeout_s=self.cfg.startup_timeout_s,
                connect_timeout_s=self._control_s,
                timeout_s=self.cfg.deadline_s,
            )
        except Exception as error:  # no port for its store at that address: hivemind carries every round
            logger.warning("the gloo data plane did not start at %s (%s): averaging through hivemind", host, error)
            return None

    def _start_averager(self, templates: Sequence[torch.Tensor], fragment: int):
        from diloco.comm.hivemind.averager import ExactAverager

        cfg = self.cfg
        # one flat buffer that the averaged tensors are views of: the data plane reduces it whole
        flat = torch.zeros(sum(t.numel() for t in templates), dtype=torch.float32)
        self._flats.append(flat)
        views = [view.view(t.shape) for view, t in zip(flat.split([t.numel() for t in templates]), templates)]
        return ExactAverager(
            views,
            self._dht,
            codec=self.codec,
            run_key=resolve_run_key(cfg.run_key),
            client_mode=self.client_mode,
            max_norm_ratio=cfg.max_norm_ratio,
            clip_to_median=cfg.clip_to_median,
            start=True,
            prefix=f"{cfg.run_id}_avg" + (f"_f{fragment}" if fragment else ""),
            target_group_size=self.num_workers,
            min_group_size=2,
            # a reducer's share of the vector is in proportion to the bandwidth it declares: a slow
            # link then carries little more than its own contribution (None = the group's average)
            bandwidth=cfg.bandwidth_mbps or None,
            min_matchmaking_time=cfg.matchmaking_s,
            request_timeout=cfg.request_timeout_s,
            allreduce_timeout=cfg.deadline_s,
            next_chunk_timeout=max(cfg.deadline_s / 4, cfg.request_timeout_s),
            declare_state_period=max(cfg.deadline_s, 10.0),
            shutdown_timeout=5,
        )

    @property
    def _averager(self):
        """The first fragment's averager; it also serves the worker's state to peers."""
        return self._averagers[0]

    @property
    def addresses(self) -> list[str]:
        # a client cannot be dialled: a newcomer joins through the peers it joined through
        return list(self.cfg.initial_peers) if self.client_mode else visible_addresses(self._dht)

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        try:
            if self._alone():
                return self._average_alone(tensors, weight, round_index=round_index)
            # one average of a fragment at a time: one abandoned by the trainer (PendingAverage.wait) may
            # still hold the averager; the round fails at once rather than queue behind it
            busy = self._busy[fragment]
            if not busy.acquire(blocking=False):
                return SyncResult(False, 1, weight, error="an earlier average of these tensors is still running")
            try:
                return self._average(tensors, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment)
            finally:
                busy.release()
        finally:
            self._last_round_end = time.monotonic()  # the time to the next round is compute

    def _average(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int
    ) -> SyncResult:
        result = self._average_in_group(
            tensors, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
        )
        if not result.averaged and self.client_mode and not self._said_unreachable_run and self._live_others() == 0:
            self._said_unreachable_run = True  # clients cannot average among themselves
            logger.warning(
                "no worker of the run that can be dialled is live: clients alone cannot average; "
                "forward a port and set comm.announce_host, or start one worker on a public address"
            )
        return result

    def _average_in_group(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int
    ) -> SyncResult:
        averager = self._averagers[fragment]
        expected = self.expected_peers()
        deadline = time.monotonic() + deadline_s
        # the hard stop of the whole round, retry included (comm/bounds.py): hivemind's own timeouts
        # bound matchmaking and the all-reduce, and this bounds hivemind
        limit = time.monotonic() + round_limit_s(deadline_s)
        result = self._average_once(
            averager,
            tensors,
            weight,
            round_index=round_index,
            attempt=0,
            expected=expected,
            timeout_s=deadline_s,
            limit=limit,
        )
        if not result.ok and not result.group and self._alone():  # the others left while we looked for a group
            return self._average_alone(tensors, weight, round_index=round_index)
        remaining = deadline - time.monotonic()
        if (
            not result.averaged  # a partial round holds the group's common mean already: nothing to redo
            and result.peers
            and result.bytes_sent
            and self._published is not None  # the others' state offers tell whether they failed too
            and len(self._averagers) == 1  # not for a fragment's sync: offers are of whole rounds (overlap.py)
            and remaining > self.cfg.request_timeout_s
            and not self._averaged_by_others(round_index)
        ):
            # the group formed but broke (a peer crashed or was cut off inside the all-reduce): the
            # survivors hold partial averages that differ; averaging once more among them, under a
            # key of its own, gives them the same result instead. They retry at about the same
            # time; the retry's leader starts after comm.matchmaking_s with whoever is there.
            logger.warning("round %d: %s; trying once more among the peers still there", round_index + 1, result.error)
            retry = self._average_once(
                averager,
                tensors,
                weight,
                round_index=round_index,
                attempt=1,
                expected=expected,
                timeout_s=min(remaining, 2 * self.cfg.matchmaking_s),
                limit=limit,
            )
            retry.bytes_sent += result.bytes_sent
            retry.bytes_recv += result.bytes_recv
            result = retry
        return result

    def _alone(self) -> bool:
        """Whether no other worker is left to average with: a run planned for one, or one whose other
        workers all left or stopped their heartbeats for good (the roster). Logs when that changes."""
        alone = self.num_workers <= 1 or self._others_gone()
        if alone != self._was_alone and self.num_workers > 1:
            if alone:
                logger.warning(
                    "no other worker of the run is live (they left, or their heartbeats stopped): "
                    "outer steps are taken alone until one is back"
                )
            else:
                logger.warning("another worker is in the run again: rounds average in groups again")
        self._was_alone = alone
        return alone

    def _others_gone(self) -> bool:
        try:
            return self.roster.others_gone()
        except Exception:  # the DHT did not tell (no answer, part of the records, a dead daemon)
            logger.debug("roster read failed", exc_info=True)
            return False

    def _average_alone(self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int) -> SyncResult:
        """Nobody to talk to, but the result is what the codec makes of it, as always."""
        codec = self.codec.agreed([{"codec": self._preference(tensors, peers=1)}])
        alone = [Contribution("self", [codec.compress(t) for t in tensors], weight)]
        means, used = average_payloads(codec, alone, [t.numel() for t in tensors], round_index=round_index)
        if not used:
            return SyncResult(False, 1, weight, error="our own contribution was dropped")
        for tensor, mean in zip(tensors, means):
            tensor.copy_(mean.view_as(tensor))
        drifted = self.num_workers > 1 and bool(self.roster.vanished)
        return SyncResult(ok=True, peers=1, total_weight=weight, drifted=drifted, codec=self._named(codec))

    def _preference(self, tensors: Sequence[torch.Tensor], *, peers: int) -> int | None:
        """The codec this worker prefers for its next round (compression.name=adaptive); None for
        a fixed codec, or before its link was measured."""
        if self._meter is None:
            return None
        between_rounds_s = time.monotonic() - self._last_round_end
        return self._meter.preferred(
            numel=sum(t.numel() for t in tensors), peers=peers, between_rounds_s=between_rounds_s
        )

    def _measure(self, codec: Codec, moved_bytes: int, transfer_s: float) -> None:
        """A round's transfer, for the next preference (compression.name=adaptive)."""
        if self._meter is not None:
            self._meter.record(codec, moved_bytes, transfer_s)

    def _named(self, codec: Codec) -> str:
        """What a round's result says of its codec: its label where it was agreed per round."""
        return codec.label if self.codec.chosen_per_round else ""

    def _await_step(self, control, round_index: int, *, limit: float):
        """The step's result. A worker still looking for a group when a peer already offers the
        round's state averaged in a group (the others went ahead without it: it came late) stops
        looking, instead of matchmaking alone until the deadline; the catch-up then takes that state.
        At ``limit`` (monotonic time) it stops waiting whatever hivemind is doing."""
        started = time.monotonic()
        while True:
            self.roster.stage("averaging" if control.began_allreduce else "matchmaking")
            try:
                return control.result(timeout=max(0.0, min(_POLL_S, limit - time.monotonic())))
            except concurrent.futures.TimeoutError:
                pass
            if time.monotonic() >= limit:
                stage = "the all-reduce" if control.began_allreduce else "matchmaking"
                control.cancel()
                raise TimeoutError(f"no result from the averager after {time.monotonic() - started:.0f} s in {stage}")
            if not control.began_allreduce and self._others_averaged(round_index):
                control.cancel()
                raise TimeoutError("the others averaged this round without us")
            if not control.began_allreduce and self._others_gone():
                control.cancel()
                raise TimeoutError("no other worker of the run is live")

    def _averaged_by_others(self, round_index: int) -> bool:
        """Whether a peer offers a state of this round averaged in a group, within a moment: then the
        group broke only for us (hivemind sometimes loses a reply to one sender), nobody else will
        retry, and the round's catch-up takes that state instead."""
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while True:
            if self._others_averaged(round_index):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)

    def _others_averaged(self, round_index: int) -> bool:
        """Whether a peer offers its state after this round, averaged in a group."""
        return any(r == round_index and rank.peers > 1 for r, rank in self._state_offers())

    def _average_once(
        self,
        averager,
        tensors: Sequence[torch.Tensor],
        weight: float,
        *,
        round_index: int,
        attempt: int,
        expected: int,
        timeout_s: float,
        limit: float,
    ) -> SyncResult:
        group_bits = round_group_bits(round_index, attempt)
        sent_before, recv_before, failed_before, drops_before = averager.traffic.read()
        averager.traffic.take_contributions()  # what an earlier round left
        # the norm of what the reducers will decode, declared so that each can screen whole vectors (robust.py)
        # (a codec agreed per round is not known yet: the norm of the tensors themselves then)
        exact = self.codec.lossless or self.codec.chosen_per_round
        norm = norm_of(tensors if exact else [self.codec.restore(t) for t in tensors])
        preference = self._preference(tensors, peers=max(2, expected))
        transfer_before = averager.traffic.transfer_s()
        try:
            averager.set_group(group_bits, target_group_size=max(2, expected), timeout_s=self._control_s)
            with averager.tensors_within(self._control_s) as buffers:
                for buffer, tensor in zip(buffers, tensors):
                    buffer.copy_(tensor)
            plane = self._plane.declaration() if self._plane is not None else {}
            declared = {"weight": weight, "norm": norm, **plane}
            if preference is not None:
                declared["codec"] = preference  # the group takes the most lossy preference (adaptive.py)
            control = averager.step(weight=weight, gather=declared, timeout=timeout_s, wait=False)
            gathered = self._await_step(control, round_index, limit=limit)
        except Exception as error:  # hivemind raises a zoo of errors; a failed round is a result
            gathered, failure = None, f"{type(error).__name__}: {error}"
        else:
            failure = "" if gathered is not None else "no group found before the deadline"
        finally:
            self.roster.stage(None)
        sent, recv, failed, drops = averager.traffic.read()
        sent, recv, failed_values = sent - sent_before, recv - recv_before, failed - failed_before
        transfer_s = averager.traffic.transfer_s() - transfer_before
        if failure:
            # a transfer that did not finish says the link is too slow for the codec it used (the
            # averager's process says which; nothing is measured when no all-reduce began)
            self._measure(self.codec.candidates[averager.traffic.used_codec()], sent + recv, transfer_s)
            return SyncResult(False, 1, weight, sent, recv, error=failure)
        # the group's screening (robust.py), which every peer computes alike from what it gathered
        screening = screen(
            {peer: declared_norm(g) for peer, g in gathered.items()},
            max_norm_ratio=self.cfg.max_norm_ratio,
            clip_to_median=self.cfg.clip_to_median,
        )
        codec = self.codec.agreed(gathered.values())  # as every peer of the group does
        if gloo_plane.carries(codec, list(gathered.values())):  # hivemind found the group; gloo averages
            flat, started = self._flats[self._averagers.index(averager)], time.monotonic()
            result = self._average_over_plane(flat, tensors, gathered, screening)
            self._measure(codec, result.bytes_sent + result.bytes_recv, time.monotonic() - started)
            return dataclasses.replace(result, codec=self._named(codec))
        self._measure(codec, sent + recv, transfer_s)
        if drops > drops_before:  # our own reducer could not read what we sent: neither could the others
            screening.dropped.setdefault(self._dht.peer_id, "our payload is unusable (see the averager's log)")
        if self._dht.peer_id in screening.dropped:  # the others refused our contribution: no retry
            reason = screening.dropped[self._dht.peer_id]
            error = f"the group dropped our contribution: {reason}"
            return SyncResult(False, 0, weight, sent, recv, error=error, group=len(gathered))
        if failed_values:
            # some reducer dropped out: part of the buffers hold our own values, not the mean
            error = f"{failed_values} values were not averaged"
            return SyncResult(False, 1, weight, sent, recv, error=error, group=len(gathered))
        try:
            with averager.tensors_within(self._control_s) as buffers:
                for buffer, tensor in zip(buffers, tensors):
                    tensor.copy_(buffer)
        except TimeoutError as error:
            return SyncResult(False, 1, weight, sent, recv, error=str(error), group=len(gathered))
        kept = screening.scales  # the peers whose contribution is in the mean
        total_weight = sum(float(g.get("weight", 0.0)) for peer, g in gathered.items() if peer in kept)
        counted = averager.traffic.take_contributions()
        least, most = counted if counted is not None else (len(kept), len(kept))
        if least < most:
            # a reducer averaged a part without some sender (it could not reach it, or it came late):
            # every worker holds the same mean, but that part is of fewer workers: not ok on any of them
            error = f"part of the vector was averaged over only {least} of {most} contributions"
            return SyncResult(
                False,
                least,
                total_weight,
                sent,
                recv,
                error=error,
                group=len(gathered),
                partial=True,
                codec=self._named(codec),
            )
        # every part over the same contributions: fewer than kept when every reducer refused one it
        # could not decode (the sender then knows: its own reducer refused it too)
        named = self._named(codec)
        return SyncResult(True, min(least, len(kept)), total_weight, sent, recv, group=len(gathered), codec=named)

    def _average_over_plane(self, flat: torch.Tensor, tensors, gathered: dict, screening) -> SyncResult:
        """The group's weighted mean through the data plane (gloo_plane.py): every peer scales its
        own vector by its weight and screening factor (0: dropped, it still takes part so that
        nobody waits for it), the ring all-reduce sums them, and every peer divides alike."""
        own = self._dht.peer_id
        weights = {peer: float(g.get("weight", 0.0)) for peer, g in gathered.items()}
        kept = screening.scales
        total_weight = sum(weights[peer] for peer in kept)
        moved = gloo_plane.ring_bytes(flat.numel(), len(gathered))
        factor = weights[own] * kept[own] if own in kept else 0.0
        self.roster.stage("averaging")
        try:
            if factor == 0.0:
                flat.zero_()  # not mul_: our dropped vector may hold NaN
            elif factor != 1.0:
                flat.mul_(factor)
            self._plane.all_reduce_sum(flat, gathered, own)
            if own not in kept:
                reason = screening.dropped.get(own, "dropped")
                error = f"the group dropped our contribution: {reason}"
                return SyncResult(False, 0, weights[own], moved, moved, error=error, group=len(gathered))
            flat.div_(total_weight)
            if not all_finite(flat):
                raise ValueError("the mean is not finite")
        except Exception as error:  # a peer gone or cut off, a timeout: the group's round failed
            error = f"data plane: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            return SyncResult(False, 1, weights[own], moved, moved, error=error, group=len(gathered))
        finally:
            self.roster.stage(None)
        for mean, tensor in zip(flat.split([t.numel() for t in tensors]), tensors):
            tensor.copy_(mean.view_as(tensor))
        return SyncResult(True, len(kept), total_weight, moved, moved, group=len(gathered))

    def expected_peers(self) -> int:
        try:
            return self.roster.expected()
        except Exception:  # the DHT did not answer: fall back to the plan
            logger.debug("roster read failed", exc_info=True)
            return self.num_workers

    def report_progress(self, round_index: int, step: int, stats: dict | None = None) -> None:
        self.roster.progress(round_index, step, stats)

    def report_phase(self, phase: str, since: float) -> None:
        self.roster.phase(phase, since)

    def announce_run(self, identity: dict) -> None:
        self.roster.run = dict(identity)

    def live_workers(self) -> dict[int, RosterEntry]:
        try:
            return self.roster.entries()
        except TimeoutError as error:
            logger.warning("reading the run's roster: %s", error)
            return {}

    def publish_state(self, round_index: int, rank: StateRank, state: StateReader) -> None:
        self._published = (round_index, rank)
        if self.client_mode:  # nobody can dial us to download it (hivemind refuses to share in client mode)
            return
        self._averager.share_state(  # serialized only when a peer asks for it
            {"round": round_index, "peers": rank.peers, "fingerprint": rank.fingerprint},
            state,
            priority=_priority(round_index, rank),
        )

    def fetch_state(
        self, round_index: int, *, better_than: StateRank, timeout_s: float, newer: bool = False
    ) -> PeerState | None:

        def wanted(offered_round: int, rank: StateRank, ours: StateRank, everyone_offered: bool) -> bool:
            if newer and offered_round > round_index:
                return True
            if offered_round != round_index or not rank > ours:
                return False
            # a bigger group's state at once when no other group can match it any more; any other
            # once every live peer has offered the round: before, the peer that wins (a bigger
            # group, or one of ours by its fingerprint) may still be in its outer step, and what we
            # took would be params that its owner drops a moment later for the winner's
            return (rank.peers > ours.peers and unmatched(rank)) or everyone_offered

        def unmatched(rank: StateRank) -> bool:
            # groups share no worker: besides that group and us, the workers not seen in a smaller
            # one this round are too few to make another of its size
            smaller = sum(1 for r, o in offers if r == round_index and o.peers < rank.peers)
            return workers - rank.peers - 1 - smaller < rank.peers

        deadline = time.monotonic() + timeout_s
        # a live peer that has not offered by half the time is a straggler (stuck in a sync of its
        # own), not one finishing its outer step: the offers there are then everyone's, and it
        # takes the winner's state itself when it comes
        patient_until = time.monotonic() + timeout_s / 2
        download_failed = False
        while time.monotonic() < deadline:
            offers = self._state_offers()
            live = self._live_peers()
            others = None if live is None else live[0]
            workers = max(self.num_workers, 0 if live is None else live[1])  # who can be in a group
            if others == 0 and (not offers or download_failed):
                return None  # nobody live can serve a state (clients only, alone, or what is offered is stale)
            # every live peer that serves state has offered this round (one still in its outer step
            # has not). Offers left by peers gone since are not waited for; an unread roster (None)
            # is not "everyone"
            everyone_offered = others is not None and sum(r >= round_index for r, _ in offers) >= others
            everyone_offered = everyone_offered or (others is not None and time.monotonic() > patient_until)
            ours = better_than
            if (
                self.client_mode
                and everyone_offered
                and not any(_same_offer((r, rank), (round_index, better_than)) for r, rank in offers)
            ):
                # nobody can take our state (a client serves none) and no peer that serves holds
                # it: between states of one size, any served one wins over ours, or we stay apart
                ours = StateRank(better_than.peers, -1.0)
            if any(wanted(r, rank, ours, everyone_offered) for r, rank in offers):
                # hivemind downloads from the highest priority first: the newest round, then the best rank
                started = time.monotonic()
                found = self._download_state(max(1.0, deadline - time.monotonic()))
                if found is not None:
                    metadata, tensors = found
                    offered_round = metadata.get("round", -1)
                    rank = StateRank(metadata.get("peers", 0), metadata.get("fingerprint", 0.0))
                    if wanted(offered_round, rank, ours, everyone_offered) and tensors:
                        logger.info(
                            "downloaded the state of a peer after round %d: %d bytes in %.2f s",
                            offered_round + 1,
                            tensors[0].numel(),
                            time.monotonic() - started,
                        )
                        state = torch.load(io.BytesIO(memoryview(tensors[0].numpy())), weights_only=True)
                        return PeerState(offered_round, rank, state)
                download_failed = True
            elif everyone_offered:
                # none ranks above us. A peer still in its outer step has not offered this round
                # yet: wait for it rather than take the others' offers (a dropped peer's, say)
                return None
            # the others may still be finishing this round's outer step: ask again shortly
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return None

    def sole_state_source(self) -> bool:
        if self.client_mode:  # nobody can take our state
            return False
        try:
            return self.roster.serves_alone()
        except Exception:  # the DHT did not tell: someone may serve a state of their own
            logger.debug("roster read failed", exc_info=True)
            return False

    def _download_state(self, timeout_s: float):
        """hivemind's download of the best state offered, or None when it did not end within ``timeout_s``."""
        try:
            return self._averager.load_state_from_peers(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            logger.warning("downloading a peer's state: no answer within %.0f s", timeout_s)
            return None

    def finish(self) -> None:
        # our last round may be over while we still send a peer its averaged parts (we reduced them
        # for it): wait for those replies to go out, at most a moment
        deadline = time.monotonic() + self._control_s
        while any(a.traffic.serving() for a in self._averagers) and time.monotonic() < deadline:
            time.sleep(0.05)  # the averager's process closes its streams; bounded by the deadline
        # after the last round nobody would serve a peer that lost part of it: linger while a live
        # peer offers an older state or a worse one of that round (it may be fetching ours), at
        # most comm.matchmaking_s
        if self._published is None or self.client_mode:  # a client serves no state: nobody waits on it
            return
        last_round, rank = self._published
        deadline = time.monotonic() + self.cfg.matchmaking_s
        while time.monotonic() < deadline and (
            any(r < last_round or (r == last_round and o < rank) for r, o in self._state_offers())
            or self._clients_behind()
        ):
            time.sleep(0.5)

    def _clients_behind(self) -> bool:
        """Whether a live client has not finished the rounds we have: it offers no state, so only its
        roster record tells, and after a lost part it can take a state only from a peer like us."""
        try:
            entries = self.roster.own_entries()
        except Exception:  # the DHT did not tell: wait for nobody in particular
            return False
        done = self.roster.rounds_done
        return any(
            i != self.roster.worker_index and not e.leaving and not e.serves_state and e.round < done
            for i, e in entries.items()
        )

    def _live_others(self) -> int | None:
        """Live workers besides us that serve their state (not in client mode), from their roster
        records: the offers to wait for (a planned worker never seen is not waited for). None when
        the DHT did not answer."""
        live = self._live_peers()
        return None if live is None else live[0]

    def _live_peers(self) -> tuple[int, int] | None:
        """(``_live_others()``, live workers in all, clients and us included), from one roster read;
        None when the DHT did not answer, or found only part of the records."""
        try:
            entries = self.roster.own_entries()
        except Exception:
            logger.debug("roster read failed", exc_info=True)
            return None
        live = [(i, e) for i, e in entries.items() if not e.leaving]
        return sum(1 for i, e in live if i != self.roster.worker_index and e.serves_state), len(live)

    def _state_offers(self) -> list[tuple[int, StateRank]]:
        """(round, rank) of the state each other live peer offers, from the priorities it declares on the DHT."""
        key = f"{self._averager.prefix}.all_averagers"
        try:
            entry = self._dht_call(lambda dht: dht.get(key, latest=True, return_future=True))
        except TimeoutError as error:  # no offers seen this time; the callers ask again or give up at their bound
            logger.warning("reading the peers' state offers: %s", error)
            return []
        if entry is None or not isinstance(entry.value, dict):
            return []
        offers, own = [], self._dht.peer_id.to_bytes()
        for subkey, declared in entry.value.items():
            if subkey == own:
                continue
            priority = getattr(declared, "value", None)
            if isinstance(priority, int | float) and priority > 0:
                offers.append(_offer(priority))
        return offers

    def leave(self) -> None:
        self.roster.leave()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.roster.stop()
        if self._plane is not None:
            self._plane.close()
        for part in (*self._averagers, self._dht):
            try:
                part.shutdown()
            except Exception:  # shutting down a half-dead daemon must not hide the real error
                logger.debug("error while shutting down %s", part, exc_info=True)
