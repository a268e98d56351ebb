"""A helper: a public peer that reduces parts of every round's vector for a run's workers and
contributes nothing of its own (hivemind's auxiliary mode).

Workers behind NAT are clients: they can send their contribution and take the mean, never reduce a
part for others, so a run whose workers are all clients cannot average by itself. A helper on a
public address fills that place: it follows the run's roster, and as soon as a worker looks for
the group of round ``r`` it looks for it too, under the same key (``group_round.round_group_bits``);
it declares itself a helper, so that every worker leaves it out of the round's contributors
(``helper_record.contributors``), and hivemind gives it the parts it reduces in proportion to the
bandwidth it declares (``comm.bandwidth_mbps``). It keeps a record fresh under the run's helpers
key (``helper_record.py``), from which workers size the group a round waits for. It trains
nothing: the tensors it is built on only give the shapes of what the workers send (which its join
request must present, as theirs do). In a run of clients, where no worker serves a state, it
relays one: a client that holds a state a worker asks for uploads it, and the helper offers it
(``state_relay.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from diloco.comm.base import CommError
from diloco.comm.bounds import round_limit_s
from diloco.comm.config import CommConfig
from diloco.comm.hivemind.averaging import start_averager, wait_for_replies
from diloco.comm.hivemind.group_round import LEFT_BEHIND, await_result, left_behind_since, round_group_bits
from diloco.comm.hivemind.helper_record import HELPER, HelperRecord, contributors, live_helpers
from diloco.comm.hivemind.membership import HivemindMembership
from diloco.comm.hivemind.peer import Peer
from diloco.comm.hivemind.roster import Roster
from diloco.comm.hivemind.roster_records import RosterEntry
from diloco.comm.hivemind.state_access import say_if_open
from diloco.comm.hivemind.state_offers import priority
from diloco.comm.hivemind.state_relay import RelayedStates, UploadServer
from diloco.comm.run_key_env import resolve_run_key
from diloco.compression import Codec

logger = logging.getLogger(__name__)

_POLL_S = 0.5  # how often the helper reads the roster for a worker looking for a group
_REMEMBERED = 64  # rounds back that the helper remembers joining (none is looked for that late)


@dataclasses.dataclass
class Reduced:
    """What the helper did in one round: the workers whose parts it reduced (none: no group, or
    the group broke), the bytes it received and sent, its time, and why it failed."""

    round_index: int
    workers: int
    bytes_recv: int
    bytes_sent: int
    seconds: float
    error: str = ""

    def line(self) -> str:
        mb = f"{self.bytes_recv / 1e6:.2f} MB in, {self.bytes_sent / 1e6:.2f} MB out, {self.seconds:.1f} s"
        if self.error:
            return f"round {self.round_index + 1}: not reduced ({self.error}; {mb})"
        return f"round {self.round_index + 1}: reduced parts for {self.workers} workers ({mb})"


class Helper:
    """The helper peer of run ``cfg.run_id`` for vectors of the tensors shaped ``shapes`` (one
    fragment: what every worker averages), sent compressed by ``codec``; ``planned``: the run's
    ``worker.count``. Raises ``CommError`` when it cannot be dialled (a helper behind NAT helps nobody)."""

    def __init__(self, cfg: CommConfig, *, shapes: Sequence[Sequence[int]], codec: Codec, planned: int):
        self.cfg = cfg
        self.peer = Peer(cfg.hivemind, run_key=cfg.run_key)
        self.averager = self.record = self.uploads = None
        self.relayed = RelayedStates()
        self._offered: int | None = None  # the round of the relayed state it offers
        try:
            if self.peer.client_mode:
                raise CommError(
                    "this helper cannot be dialled by the run's peers: forward a port and set "
                    "comm.hivemind.announce_host, or run it on a public address"
                )
            tensors = [torch.zeros(tuple(shape), dtype=torch.float32) for shape in shapes]
            self.averager = start_averager(
                cfg, self.peer, tensors, codec=codec, fragment=0, num_workers=planned, auxiliary=True
            )
            say_if_open(resolve_run_key(cfg.run_key), who="helper", what="the states it relays")
            heartbeat_s = cfg.hivemind.heartbeat_s
            self.roster = Roster(
                self.peer.call, run_id=cfg.run_id, worker_index=-1, planned=planned, heartbeat_s=heartbeat_s
            )
            self.membership = HivemindMembership(self.roster, self.peer, num_workers=planned)  # what it reads
            self.record = HelperRecord(
                self.peer.call,
                run_id=cfg.run_id,
                peer_id=str(self.peer.peer_id),
                addresses=self.addresses,
                heartbeat_s=heartbeat_s,
            )
            self.record.start()
            self.uploads = UploadServer(
                self.peer.call, cfg.run_id, self.relayed, refuses=self._refuses_upload, timeout_s=cfg.deadline_s
            )
            self.uploads.start()
        except BaseException:
            self.shutdown()
            raise

    @property
    def addresses(self) -> list[str]:
        return self.peer.visible_addresses

    def serve(self, report: Callable[[Reduced], None], *, stop: threading.Event | None = None) -> str:
        """Reduce in every round the workers start, calling ``report`` after each, until ``stop`` is
        set or the run's workers have all been gone for a record's lifetime; returns why it stopped."""
        stop = stop or threading.Event()
        done: set[int] = set()  # the rounds it joined (or gave up on)
        live_at = time.monotonic()
        while not stop.wait(_POLL_S):
            self._offer_relayed()
            try:
                entries = {i: e for i, e in self.roster.entries().items() if not e.leaving}
            except Exception:  # the DHT did not answer this time: the next read may
                logger.debug("roster read failed", exc_info=True)
                entries = {}
            if not entries:
                if time.monotonic() - live_at > self.roster.ttl_s:
                    return "no worker of the run is live any more"
                continue
            live_at = time.monotonic()
            self._withdraw_stale(entries.values())
            looking = [e for e in entries.values() if e.protocol.stage == "matchmaking" and e.round not in done]
            if not looking:
                continue
            # the round most workers look for (the latest of those), whatever a late one does
            counts = collections.Counter(entry.round for entry in looking)
            round_index = max(counts, key=lambda r: (counts[r], r))
            done = {r for r in done if r > round_index - _REMEMBERED} | {round_index}
            announced = max(entry.protocol.group for entry in looking if entry.round == round_index)
            report(self._reduce(round_index, announced=announced))
        return "stopped"

    def _refuses_upload(self, peer: str, offered_round: int) -> str:
        """Why a state uploaded by ``peer`` after round ``offered_round`` must not be relayed ("" if not)."""
        live = [entry for entry in self.roster.entries().values() if not entry.leaving]
        if peer not in {entry.peer for entry in live}:
            return "not a live worker of the run"
        if offered_round >= max(entry.round for entry in live) + 1:  # records may lag by a round
            return f"round {offered_round + 1}: no live worker has completed round {offered_round}"
        return ""

    def _offer_relayed(self) -> None:
        """Offer the newest state a client uploaded, as a worker offers its own."""
        taken = self.relayed.take()
        if taken is None:
            return
        offer, metadata, blob = taken
        self.averager.allow_state_sharing = True
        self.averager.share_state(metadata, lambda _serialize: io.BytesIO(blob), priority=priority(*offer))
        self._offered = offer[0]

    def _withdraw_stale(self, live: Iterable[RosterEntry]) -> None:
        """Stop offering the relayed state once every live worker is past its round: nobody behind
        wants it any more, and a newcomer must not take it for the run's."""
        if self._offered is None or not everyone_past(self._offered, live):
            return
        self.averager.allow_state_sharing = False
        self.relayed.forget()
        logger.info("withdrew the state after round %d: every live worker is past it", self._offered + 1)
        self._offered = None

    def _reduce(self, round_index: int, *, announced: int) -> Reduced:
        """Join round ``round_index``'s group: of the size the workers announced, or (a worker that
        counted the helpers before this one was up) of the live workers and helpers, this one
        included, whichever is more; if it broke inside the all-reduce, the workers' retry too."""
        group_size = max(announced, self.membership.expected_peers() + live_helpers(self.peer.call, self.cfg.run_id), 2)
        left_before = self.averager.traffic.groups_left_behind()
        result = self._attempt(round_index, 0, group_size, self.cfg.deadline_s, left_before=left_before)
        left_behind = left_behind_since(self.averager, left_before)
        if result.error and (result.bytes_recv or left_behind):  # the group broke: the survivors try once more
            retry = self._attempt(round_index, 1, group_size, 2 * self.cfg.hivemind.matchmaking_s)
            retry.bytes_recv += result.bytes_recv
            retry.bytes_sent += result.bytes_sent
            retry.seconds += result.seconds
            result = retry
        return result

    def _attempt(
        self, round_index: int, attempt: int, group_size: int, timeout_s: float, *, left_before: int | None = None
    ) -> Reduced:
        """One try at the round's group; one that counted us in after we had given up on it (we
        refused its parts: ``left_before`` is the count before) stops it (``averaging.py``)."""
        averager = self.averager

        def pointless() -> str:
            if left_behind_since(averager, left_before):
                return LEFT_BEHIND
            return self._past(round_index)

        started, (sent_before, recv_before, _, _) = time.monotonic(), averager.traffic.read()
        error, workers = "", 0
        try:
            averager.set_group(
                round_group_bits(round_index, attempt), target_group_size=group_size, timeout_s=self.peer.control_s
            )
            control = averager.step(gather={HELPER: True}, timeout=timeout_s, wait=False)
            gathered = await_result(
                control,
                limit=started + round_limit_s(timeout_s),
                pointless=pointless,
                # a state a client uploads now may be what a worker of this very group waits for
                stage=lambda _stage: self._offer_relayed(),
            )
            if gathered is None:
                error = "no group found before the deadline"
            else:
                workers = len(contributors(gathered))
                # the round is over once the reducers finished: the replies' bytes count too
                wait_for_replies([averager], timeout_s=self.peer.control_s)
        except Exception as failure:  # hivemind raises a zoo of errors; a failed round is a result
            error = f"{type(failure).__name__}: {failure}".strip()
        sent, recv, _, _ = averager.traffic.read()
        return Reduced(round_index, workers, recv - recv_before, sent - sent_before, time.monotonic() - started, error)

    def _past(self, round_index: int) -> str:
        """Why looking for round ``round_index``'s group is pointless: every live worker has finished it."""
        try:
            entries = [e for e in self.roster.entries().values() if not e.leaving]
        except Exception:  # the DHT did not answer this time: keep looking
            return ""
        past = bool(entries) and all(entry.round > round_index for entry in entries)
        return "the workers averaged this round without us" if past else ""

    def shutdown(self) -> None:
        """Say it is gone (no round waits for it), then stop its averager and its peer."""
        if self.record is not None:
            self.record.leave()
        if self.uploads is not None:
            self.uploads.close()
        for part in (self.averager, self.peer):
            try:
                if part is not None:
                    part.shutdown()
            except Exception:  # shutting down a half-dead daemon must not hide the real error
                logger.debug("error while shutting down %s", part, exc_info=True)


def everyone_past(offered_round: int, live: Iterable[RosterEntry]) -> bool:
    """Whether every live worker (``live``, their records) has completed a round after round
    ``offered_round``, the one a relayed state comes from (a record counts the rounds completed)."""
    rounds = [entry.round for entry in live]
    return bool(rounds) and min(rounds) > offered_round + 1
