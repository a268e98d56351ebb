"""hivemind's decentralized averager, changed so that every peer ends a round bit-identical.

``ExactAverager`` runs each round's all-reduce as ``ExactAllReduceRunner`` (``exact_allreduce.py``:
a reducer hands out the average itself, not a delta), its parts in the run's codec on the wire
(``wire.py``), screened alike on every peer (``screening.py``), counted in shared counters
(``traffic.py``); it serves the worker's state (``state_serving.py``) and downloads a peer's
(``state_download.py``), in a keyed run to and from key holders only (``state_access.py``).
Here: the averager itself, in its own process, a round's group set by the worker, a part for a
group we are not in refused, and bounded calls to the averager's process.
Every hivemind method it overrides is listed in ``overrides.py``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import signal
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter, azip
from hivemind.utils.mpfuture import MPFuture

from diloco.comm.hivemind import gathered, gloo_plane, log_filters, overrides
from diloco.comm.hivemind.exact_allreduce import ExactAllReduceRunner
from diloco.comm.hivemind.exclusion import Exclusions
from diloco.comm.hivemind.forked import release_inherited_tensors
from diloco.comm.hivemind.run_key import keyed_schema_hash
from diloco.comm.hivemind.screening import declared_data, screen_round
from diloco.comm.hivemind.state_access import StateAccess
from diloco.comm.hivemind.state_download import StateDownload
from diloco.comm.hivemind.state_serving import StateServing
from diloco.comm.hivemind.traffic import TrafficCounters
from diloco.comm.hivemind.wire import aligned_part_size_bytes
from diloco.comm.robust import NO_SCREENING, ScreeningRules, declared_weights
from diloco.comm.verdicts import SketchHistory
from diloco.compression import PAYLOAD_FORMAT, Codec
from diloco.lifetime import die_with_parent, shielded_from_interrupts

logger = logging.getLogger(__name__)


class ExactAverager(StateServing, StateDownload, DecentralizedAverager):
    """A ``DecentralizedAverager`` whose rounds leave every peer with identical tensors.

    It runs in its own process (as hivemind's does); the byte counts and the share of the vector
    whose reducer failed are passed back through ``traffic``, shared counters.
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht,
        *,
        codec: Codec,
        run_key: str = "",
        rules: ScreeningRules = NO_SCREENING,
        standings: Path | None = None,
        start: bool,
        **kwargs,
    ):
        overrides.warn_if_not_pinned()
        self.traffic, self.codec = TrafficCounters(), codec
        self._refused_groups: collections.deque[bytes] = collections.deque(maxlen=64)  # counted once each
        self.rules = rules
        self.sketch_history = SketchHistory()  # earlier rounds' sketches, to tell a replay (verdicts.py)
        # comm.exclude_after, across this peer's rounds (saved to ``standings``, read back on a restart)
        self.exclusions = Exclusions(rules.exclude_after, standings, readmit_after=rules.readmit_after)
        self._serve_parts()  # the state that peers download (state_serving.py) ...
        self.access = StateAccess(run_key)  # ... in a keyed run, key holders only (state_access.py)
        super().__init__(
            averaged_tensors,
            dht,
            part_size_bytes=aligned_part_size_bytes(codec, sum(t.numel() for t in averaged_tensors)),
            start=False,
            **kwargs,
        )
        # a join request must present the leader's schema hash: keyed, only run-key holders can;
        # only peers of the same payload format can join; a codec that gathers replies in another
        # format (gathered.py): only its like can join, and a codec chosen per round only peers of
        # the same candidates
        schema = self.schema_hash + PAYLOAD_FORMAT
        schema += gathered.FORMAT if any(c.gathers for c in codec.candidates) else b""
        if codec.chosen_per_round:  # peers agree on a codec by index: only those of the same candidates
            schema += codec.describe().encode()
        self.schema_hash = keyed_schema_hash(run_key, schema)
        if start:
            self.run_in_background(await_ready=True)

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        # hivemind's own sets SIGINT to SIG_IGN in the worker and leaves it so: Ctrl-C did nothing
        with shielded_from_interrupts():
            self.start()
        if await_ready:
            self.wait_until_ready(timeout)

    def run(self):
        # in the averager's own process: it dies with the worker, however the worker dies (lifetime.py)
        die_with_parent(signal.SIGKILL, parent_pid=self._parent_pid)
        release_inherited_tensors()  # the worker's model, forked with us: we read only the shared buffers
        log_filters.install()
        super().run()

    def set_group(self, group_bits: str, *, target_group_size: int, timeout_s: float) -> None:
        """Match the next round under ``group_bits``, starting it as soon as ``target_group_size`` peers
        are in. Raises ``TimeoutError`` if the averager's process does not take it within ``timeout_s``."""
        sent = dict(group_bits=group_bits, target_group_size=target_group_size)
        ask_within(self._outer_pipe, "_set_group", sent, timeout_s=timeout_s, what="the round's group key")

    def tensors_within(self, timeout_s: float):
        """``get_tensors()``, waiting at most ``timeout_s`` for the averager to release them (it holds
        them through an all-reduce, one given up on included); raises ``TimeoutError`` past it."""
        return held_within(self.lock_averaged_tensors, self._averaged_tensors, timeout_s)

    async def _set_group(self, group_bits: str, target_group_size: int, future: MPFuture):
        try:
            matchmaking = self._matchmaking
            matchmaking.group_key_manager.group_bits = group_bits
            # the next key is set here every round: hivemind's own key update must not fail on a
            # group bigger than it planned for (a worker joined), so it sizes by the group instead
            matchmaking.group_key_manager.target_group_size = None
            matchmaking.target_group_size = target_group_size
            matchmaking.potential_leaders.target_group_size = target_group_size
            future.set_result(None)
        except Exception as error:
            if not future.done():
                future.set_exception(error)

    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:  # typing's: hivemind reads the handler's kind from them
        # hivemind holds a part for a group it does not know until its own matchmaking ends: right
        # when the leader's answer to us is merely late, but a leader can also count us in a group
        # we had given up on (its answer came past our request's timeout), and then every sender
        # waits its whole reducer timeout for our share while we look for a group all round. Once
        # we follow no leader and hold no group, past a bound, we answer that the group is not ours
        # and the others go on without us at once.
        request = await anext(stream)
        matchmaking = self._matchmaking
        if not await group_registered(
            request.group_id,
            self._running_groups,
            self._pending_groups_registered,
            UNKNOWN_GROUP_WAIT * self.request_timeout,
            joining=lambda: matchmaking.current_leader is not None or matchmaking.assembled_group.done(),
        ):
            logger.warning(
                "peer %s sent a part for a group we are not in (a leader counted us in after we left it): refused",
                context.remote_id,
            )
            if request.group_id not in self._refused_groups:  # each of its senders asks: one group
                self._refused_groups.append(request.group_id)
                self.traffic.groups_left_behind(+1)  # our round stops looking for a group and retries (averaging.py)
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs
    ):
        group_id = group_info.group_id if group_id is None else group_id
        declared, modes = declared_data(self.serializer, group_info)
        codec = self.codec.agreed(declared.values())  # the round's (compression/adaptive.py)
        self.traffic.used_codec(self.codec.candidates.index(codec))
        if gloo_plane.carries(codec, list(declared.values())):
            # the workers average this group's vectors through the data plane, not through us
            self._running_groups[group_id].set_result(None)
            return
        norms, screening, excluded = screen_round(
            declared, self.rules, self.exclusions, own=self.peer_id, history=self.sketch_history
        )
        started = time.monotonic()
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            modes=modes,
            traffic=self.traffic,
            codec=codec,
            screening=screening,
            norms=norms,
            weights=declared_weights(declared),
            **kwargs,
        )
        assert group_id in self._running_groups, f"group {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        try:
            if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
                async for _ in runner:
                    raise ValueError("auxiliary peers do not receive averaged tensors")
            else:
                async for tensor, averaged in azip(as_aiter(*tensors), runner):
                    tensor.copy_(averaged)
                self._state_updated.set()
            self.exclusions.record(runner.sender_peer_ids, screening, excluded, runner, own=self.peer_id)
        finally:
            self.traffic.add(
                failed_values=runner.tensor_part_container.failed_size,
                lost_reducers=runner.lost_reducers,
                transfer_s=time.monotonic() - started,
            )


# how many of hivemind's request timeouts a part for a group we do not know waits for us to
# register that group (the leader's answer to us on its way), before we refuse it
UNKNOWN_GROUP_WAIT = 2
_JOINING_POLL_S = 0.25  # how often a wait past its bound asks whether we are still joining a group


async def group_registered(
    group_id: bytes,
    running: Mapping[bytes, asyncio.Future],
    registered: asyncio.Event,
    timeout_s: float,
    *,
    joining: Callable[[], bool] = lambda: False,
) -> bool:
    """Whether ``group_id`` is among the ``running`` groups, or is registered before we give up:
    hivemind clears ``registered`` while matchmaking and sets it once a group is registered (or
    given up). We give up past ``timeout_s`` once ``joining()`` is false (we follow no leader and
    hold no assembled group: a group that counts us in is not one we can still register)."""
    if group_id in running:
        return True
    deadline = time.monotonic() + timeout_s
    while not registered.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not joining():
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(registered.wait(), remaining if remaining > 0 else _JOINING_POLL_S)
    return group_id in running


def ask_within(pipe, method: str, kwargs: dict, *, timeout_s: float, what: str) -> None:
    """Have the averager's process run ``method(**kwargs, future=...)`` through ``pipe``; raises
    ``TimeoutError`` naming ``what`` if it has not done so within ``timeout_s``."""
    future = MPFuture()
    pipe.send((method, [], dict(kwargs, future=future)))
    try:
        future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise TimeoutError(f"the averager did not take {what} within {timeout_s:.0f} s") from None


@contextlib.contextmanager
def held_within(lock, tensors: list, timeout_s: float):
    """``tensors`` under ``lock`` (the averager's, shared with its process), waiting at most
    ``timeout_s`` for it; raises ``TimeoutError`` past it."""
    if not lock.acquire(timeout=timeout_s):
        raise TimeoutError(f"the averager held its tensors for more than {timeout_s:.0f} s (an earlier all-reduce)")
    try:
        yield tensors
    finally:
        lock.release()
