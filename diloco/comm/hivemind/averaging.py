"""A round's averaging over hivemind: one averager per fragment of the params, the round's retry
among survivors, and the outer step taken alone when nobody else is left.

Each round is matched under its own DHT key (run id + round number), so a worker that is a round
behind never averages with the others' newer pseudo-gradients; each worker's roster record says
which rounds' averages it is done with, so one that came after all the others were done stops
looking for that round's group at once. Rounds wait up to
``comm.hivemind.matchmaking_s`` for the group the roster expects (``roster.py``: the planned
workers minus those seen gone, plus those that joined) and start at once when it is full. A round
whose group broke (a peer crashed inside the all-reduce) is tried once more among the survivors,
under a key of its own, while its deadline lasts; it starts as soon as the survivors are all
there. One attempt is ``group_round.py``; a client's round that found no group, ``others.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from diloco.comm.base import Averaging, Outcome, Staged, SyncResult
from diloco.comm.bounds import round_limit_s
from diloco.comm.config import CommConfig
from diloco.comm.hivemind.gloo_plane import DataPlane, plane_host
from diloco.comm.hivemind.group_round import Attempt, GroupRound, left_behind_since
from diloco.comm.hivemind.helper_record import RunHelpers
from diloco.comm.hivemind.membership import HivemindMembership
from diloco.comm.hivemind.others import ClientRounds, OtherWorkers
from diloco.comm.hivemind.peer import Peer
from diloco.comm.hivemind.roster import Roster, worker_names
from diloco.comm.hivemind.settings import HivemindConfig
from diloco.comm.hivemind.state_exchange import HivemindStateExchange
from diloco.comm.hivemind.state_offers import StateOffers
from diloco.comm.link_meter import CodecChoice
from diloco.comm.reduce import Contribution, average_payloads
from diloco.comm.robust import ScreeningRules
from diloco.comm.run_key_env import resolve_run_key
from diloco.compression import Codec

logger = logging.getLogger(__name__)


def start_plane(cfg: HivemindConfig, peer: Peer, *, deadline_s: float) -> DataPlane | None:
    """``comm.hivemind.data_plane=gloo``: this worker's end of the plane, unless nobody can dial it;
    its collectives give up after ``deadline_s`` (``comm.deadline_s``)."""
    if cfg.data_plane != "gloo" or peer.client_mode:
        return None
    host = plane_host(cfg.host, cfg.announce_host, peer.visible_addresses)
    try:
        return DataPlane(
            host,
            start_timeout_s=cfg.startup_timeout_s,
            connect_timeout_s=peer.control_s,
            timeout_s=deadline_s,
        )
    except Exception as error:  # no port for its store at that address: hivemind carries every round
        logger.warning("the gloo data plane did not start at %s (%s): averaging through hivemind", host, error)
        return None


def start_averager(
    cfg: CommConfig,
    peer: Peer,
    views: Sequence[torch.Tensor],
    *,
    codec: Codec,
    fragment: int,
    num_workers: int,
    state_dir: Path | None = None,
    auxiliary: bool = False,
):
    """hivemind's averager of one fragment, averaging ``views`` in place (it also serves states);
    it keeps its standings of the other peers in ``state_dir`` (the worker's checkpoints).
    ``auxiliary``: a helper's (``helper.py``), which reduces parts and contributes nothing."""
    from diloco.comm.hivemind.averager import ExactAverager

    return ExactAverager(
        views,
        peer.dht,
        codec=codec,
        run_key=resolve_run_key(cfg.run_key),
        client_mode=peer.client_mode,
        rules=ScreeningRules.of(cfg),
        standings=None if state_dir is None else state_dir / f"standings{f'-f{fragment}' if fragment else ''}.json",
        start=True,
        prefix=f"{cfg.run_id}_avg" + (f"_f{fragment}" if fragment else ""),
        auxiliary=auxiliary,
        target_group_size=num_workers,
        min_group_size=2,
        # a reducer's share of the vector is in proportion to the bandwidth it declares: a slow
        # link then carries little more than its own contribution (None = the group's average)
        bandwidth=cfg.bandwidth_mbps or None,
        min_matchmaking_time=cfg.hivemind.matchmaking_s,
        request_timeout=cfg.hivemind.request_timeout_s,
        allreduce_timeout=cfg.deadline_s,
        next_chunk_timeout=max(cfg.deadline_s / 4, cfg.hivemind.request_timeout_s),
        declare_state_period=max(cfg.deadline_s, 10.0),
        shutdown_timeout=5,
    )


class HivemindAveraging(Averaging):
    """The averaging of one worker: ``averagers`` (one per fragment, hivemind's ``ExactAverager``)
    and ``flats`` (each one's tensors as one flat buffer, which the data plane reduces whole).
    ``membership``: the group size a round waits for (``expected_peers``); ``states``: whether this
    worker offers its state after rounds (``published``: then a peer's offer tells whether a broken
    group failed for the others too); ``helpers``: the run's live helpers (``helper_record.py``),
    who join each round's group to reduce."""

    averages_in_background = True  # the averager process does the work

    def __init__(
        self,
        cfg: CommConfig,
        *,
        peer: Peer,
        roster: Roster,
        offers: StateOffers,
        codec: Codec,
        averagers: Sequence,
        flats: Sequence[torch.Tensor],
        plane: DataPlane | None,
        num_workers: int,
        membership: HivemindMembership,
        states: HivemindStateExchange,
        helpers: RunHelpers,
    ):
        self.cfg, self.codec, self.num_workers = cfg, codec, num_workers
        self._peer, self._roster, self._offers = peer, roster, offers
        self.averagers, self._flats, self.plane = list(averagers), list(flats), plane
        self._busy = [threading.Lock() for _ in self.averagers]  # held while a fragment's average runs
        self._membership, self._states, self._run_helpers = membership, states, helpers
        self.codecs = CodecChoice(codec)
        self._others = OtherWorkers(roster)
        self._client_rounds = ClientRounds(roster, self._others, helpers, peer)
        self.group_round = GroupRound(
            cfg,
            codecs=self.codecs,
            own_id=peer.peer_id,
            plane=plane,
            roster=roster,
            offers=offers,
            others=self._others,
            control_s=peer.control_s,
        )
        self._was_alone = False
        self._missing: tuple[int, ...] = ()  # the workers the roster missed at the last round

    @contextlib.contextmanager
    def staging(self, fragment: int = 0):
        with self.averagers[fragment].tensors_within(self._peer.control_s) as buffers:  # under its lock
            yield buffers

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        try:
            if self._alone():
                self._roster.finished_averaging(fragment, round_index)
                return self._noted(self._average_alone(tensors, weight, round_index=round_index))
            # one average of a fragment at a time: one abandoned by the trainer (PendingAverage.wait) may
            # still hold the averager; the round fails at once rather than queue behind it
            busy = self._busy[fragment]
            if not busy.acquire(blocking=False):
                return SyncResult(
                    Outcome.FAILED, 1, weight, error="an earlier average of these tensors is still running"
                )
            try:
                result = self._average(
                    tensors, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
                )
                return self._noted(result)
            finally:
                busy.release()
                self._roster.finished_averaging(fragment, round_index)  # a worker still looking for us stops
        finally:
            self.codecs.round_ended()  # the time to the next round is compute

    def _noted(self, result: SyncResult) -> SyncResult:
        """``result`` with the workers our averagers excluded (``exclusion.py``) and those the roster misses."""
        peers = set().union(*(averager.exclusions.excluded_peers() for averager in self.averagers))
        excluded = self._roster.workers_of(peers) if peers else ()
        return self._say_missing(dataclasses.replace(result, excluded=excluded) if excluded else result)

    def _say_missing(self, result: SyncResult) -> SyncResult:
        """``result`` with the workers the roster misses (seen, gone without leaving: crashed or cut
        off, a split run); a warning each time that set changes."""
        missing = tuple(sorted(self._roster.missing))
        if missing != self._missing:
            if missing:
                logger.warning(
                    "%s gone without leaving: crashed, or cut off from us (a split run, training apart); "
                    "rounds average among the workers still reachable until %s back",
                    f"{worker_names(missing)} {'is' if len(missing) == 1 else 'are'}",
                    "it is" if len(missing) == 1 else "they are",
                )
            self._missing = missing
        return dataclasses.replace(result, missing=missing) if missing else result

    def _average(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int
    ) -> SyncResult:
        if (behind := self._client_rounds.behind(round_index, weight)) is not None:
            return behind
        result = self._average_in_group(
            tensors, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
        )
        return self._client_rounds.left_out(result, fragment=fragment, round_index=round_index)

    def _average_in_group(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int
    ) -> SyncResult:
        averager, flat = self.averagers[fragment], self._flats[fragment]
        expected, helpers = self._membership.expected_peers(), self._run_helpers.count()
        deadline = time.monotonic() + deadline_s
        # the hard stop of the whole round, retry included (comm/bounds.py): hivemind's own timeouts
        # bound matchmaking and the all-reduce, and this bounds hivemind
        limit = time.monotonic() + round_limit_s(deadline_s)
        left_before, lost_before = averager.traffic.groups_left_behind(), averager.traffic.reducers_lost()
        first = Attempt(round_index, 0, expected, deadline_s, limit, helpers, left_before, fragment=fragment)
        self._roster.group = first.group_size  # announced: a helper waits for the same group
        result = self.group_round.run(averager, flat, tensors, weight, first)
        if not result.ok and not result.group and self._alone():  # the others left while we looked for a group
            if not restored(self, tensors, fragment):  # an attempt given up on may have changed them
                return dataclasses.replace(result, expected=expected)
            return self._average_alone(tensors, weight, round_index=round_index)
        left_behind = left_behind_since(averager, first.left_before)
        if self._worth_retrying(result, round_index, left_behind=left_behind, remaining=deadline - time.monotonic()):
            # the survivors hold partial averages that differ (or their own values); averaging once
            # more among them, under a key of its own, gives them the same result instead. They
            # retry at about the same time; the retry's leader starts after
            # comm.hivemind.matchmaking_s with whoever is there, or as soon as the group is whole
            # less the members lost inside the all-reduce (a group left behind lost none: its late
            # member retries too).
            logger.warning("round %d: %s; trying once more among the peers still there", round_index + 1, result.error)
            if not restored(self, tensors, fragment):
                return dataclasses.replace(result, expected=expected)
            retry_s = min(deadline - time.monotonic(), 2 * self.cfg.hivemind.matchmaking_s)
            lost = averager.traffic.reducers_lost() - lost_before
            lost = 0 if left_behind else _not_waited_for(lost, group=result.group, helpers=helpers)
            again = Attempt(round_index, 1, expected, retry_s, limit, helpers, fragment=fragment, lost=lost)
            retry = self.group_round.run(averager, flat, tensors, weight, again)
            sent, recv = retry.bytes_sent + result.bytes_sent, retry.bytes_recv + result.bytes_recv
            result = dataclasses.replace(retry, bytes_sent=sent, bytes_recv=recv)
        return dataclasses.replace(result, expected=expected)

    def _worth_retrying(self, result: SyncResult, round_index: int, *, left_behind: bool, remaining: float) -> bool:
        """Whether a failed first attempt is tried once more among the group's survivors, with
        ``remaining`` seconds to the round's deadline. ``left_behind``: its group broke because a
        member had given up on it before it formed (we refused its parts, or a reducer refused
        ours): each of its peers that exchanged parts with that member knows, and all retry, whole
        rounds and fragments alike (a late member that reduces no share refuses nothing). Otherwise
        a group that formed and broke (a peer crashed or was cut off inside the all-reduce) is
        retried when the others' offers of whole rounds say it failed for them too."""
        if result.averaged:  # a partial round holds the group's common mean already: nothing to redo
            return False
        if remaining <= self.cfg.hivemind.request_timeout_s:
            return False
        if left_behind:
            return True
        return (
            bool(result.peers and result.bytes_sent)
            and self._states.published is not None  # the others' state offers tell whether they failed too
            and len(self.averagers) == 1  # not for a fragment's sync: offers are of whole rounds (overlap.py)
            and not self._averaged_by_others(round_index)
        )

    def _averaged_by_others(self, round_index: int) -> bool:
        """Whether a peer offers a state of this round averaged in a group, within a moment: then the
        group broke only for us (hivemind sometimes loses a reply to one sender), nobody else will
        retry, and the round's catch-up takes that state instead."""
        deadline = time.monotonic() + self.cfg.hivemind.request_timeout_s
        while True:
            if self._offers.averaged_in_a_group(round_index):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)

    def _alone(self) -> bool:
        """Whether no other worker is left to average with: a run planned for one, or one whose other
        workers all left or stopped their heartbeats for good (the roster). Logs when that changes."""
        alone = self.num_workers <= 1 or self._others.others_gone()
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

    def _average_alone(self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int) -> SyncResult:
        # alone while workers that vanished without leaving may train on, cut off from us (or we from them)
        cut_off = self.num_workers > 1 and bool(self._roster.missing)
        return average_alone(self.codecs, tensors, weight, round_index=round_index, cut_off=cut_off)

    def finish(self) -> None:
        """Our last round may be over while we still send a peer its averaged parts (we reduced them
        for it): wait for those replies to go out, at most a moment."""
        wait_for_replies(self.averagers, timeout_s=self._peer.control_s)


def restored(averaging: HivemindAveraging, tensors: Sequence[torch.Tensor], fragment: int) -> bool:
    """Our own contribution back in ``tensors`` after a broken attempt left averaged parts in the
    averager's buffers (``Staged``); False when the averager still holds them (that attempt's all-reduce)."""
    if isinstance(tensors, Staged):
        try:
            with averaging.staging(fragment):
                tensors.restore()
        except TimeoutError:
            return False
    return True


def wait_for_replies(averagers: Sequence, *, timeout_s: float) -> None:
    """Until ``averagers`` have sent every averaged part they reduced for a peer, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(a.traffic.serving() for a in averagers) and time.monotonic() < deadline:
        time.sleep(0.05)  # the averager's process closes its streams; bounded by the deadline


def _not_waited_for(lost: int, *, group: int, helpers: int) -> int:
    """Of a broken group of ``group`` workers (0: not known) and ``helpers`` helpers, the members its
    retry need not wait for: the ``lost`` whose averaged parts never all came back to us. None when
    every other member failed us, or the group is not known: we are then the one that was cut off
    or stalled, and the others may all retry."""
    return 0 if lost >= group + helpers - 1 else lost


def average_alone(
    codecs: CodecChoice, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, cut_off: bool
) -> SyncResult:
    """A round with nobody to talk to: the mean is what the codec makes of ours, as always;
    ``cut_off`` while workers that vanished without leaving may train on."""
    codec = codecs.codec.agreed([{"codec": codecs.preference(tensors, peers=1)}])
    alone = [Contribution("self", [codec.compress(t) for t in tensors], weight)]
    means, used = average_payloads(codec, alone, [t.numel() for t in tensors], round_index=round_index)
    if not used:
        return SyncResult(Outcome.FAILED, 1, weight, error="our own contribution was dropped")
    for tensor, mean in zip(tensors, means):
        tensor.copy_(mean.view_as(tensor))
    outcome = Outcome.CUT_OFF if cut_off else Outcome.ALONE
    return SyncResult(outcome, peers=1, total_weight=weight, codec=codecs.named(codec))
