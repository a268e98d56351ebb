"""The transport interface: how workers average their pseudo-gradients, and what else they share.

A transport (``CommBackend``) is handed out in parts, each to the code that uses it: its
``averaging`` to the outer step and the sync modes (they only ever call ``all_reduce_mean`` or
``start_all_reduce``, and never branch on how bytes travel); its ``states`` and ``membership`` to
recovery and joining; its ``board`` (where offered) to the evaluation the workers holding the same
params share; its end (``finish``, ``shutdown``) to the worker that built it. A failed or
partial round is a ``SyncResult`` whose ``Outcome`` says so (comm/round_result.py), never an
exception that kills the worker.

Its settings, ``CommConfig`` (the ``comm:`` section), are in config.py.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from diloco.comm.members import LiveWorker
from diloco.comm.round_result import Outcome as Outcome  # what a round produced: importers take it from here too
from diloco.comm.round_result import SyncResult as SyncResult
from diloco.errors import CommError as CommError  # raised here; importers take it from here too

# how a worker offers its state: ``read(use)`` is ``use(live state)`` under the outer step's lock, or None once stale
StateReader = Callable[[Callable[[dict], object]], object]
# what a worker makes of a downloaded state before it takes it: core/recovery.py checks its params
StateCheck = Callable[["PeerState"], "StateVerdict"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class StateRank:
    """How good a worker's state after a round is: averaged over more peers first; between groups
    of the same size (hivemind's matchmaking can split a round in two), the larger fingerprint of
    the params, so that every group agrees on one winner and the others take its state."""

    peers: int
    fingerprint: float = 0.0  # in [0, 1): from the hash of the global params, the same across a group


def fingerprint_of(digest: bytes) -> float:
    """A ``StateRank`` fingerprint in [0, 1) from a hash digest (its first 24 bits: exact in the
    float that carries a state's download priority, see comm/hivemind/state_offers.py)."""
    return int.from_bytes(digest[:3], "big") / (1 << 24)


@dataclass(frozen=True)
class StateVerdict:
    """Whether to take a downloaded state: yes when neither field says why not."""

    refuse: str = ""  # why it must not be taken: the peer that served it is not asked again in this search
    wait: str = ""  # why it cannot be told yet: asked again shortly

    @property
    def take(self) -> bool:
        return not (self.refuse or self.wait)


@dataclass
class PeerState:
    """A state downloaded from a peer: after which round, how it ranked, the state itself, and
    the peer that served it (its transport's id; "" where not known)."""

    round: int
    rank: StateRank
    state: dict
    served_by: str = ""


@dataclass(frozen=True)
class Declared:
    """What a live worker last declared of its params (blocking rounds declare them each round)."""

    rounds_done: int  # the round its digest is of
    digest: str  # the first 16 hex digits of its params' digest
    progress: int  # rounds it has completed: one more than ``rounds_done`` while it hashes, say
    peer: str = ""  # its peer's id (``PeerState.served_by``), to tell a state's server apart
    peers: int = 0  # the workers its last round counted (1: it ended that round alone); 0 = not said


class Staged(list):
    """Tensors that are a transport's own buffers (``Averaging.staging``), handed to its
    ``all_reduce_mean`` with ``restore``, which writes the caller's contribution into them again:
    an attempt that broke part-way leaves averaged parts in them, and the transport calls it before
    it tries again. After a round that did not average (``SyncResult.averaged``) they hold no
    defined values: the caller forms its contribution again if it needs it."""

    def __init__(self, tensors: Sequence[torch.Tensor], restore: Callable[[], object]):
        super().__init__(tensors)
        self.restore = restore


class Averaging(abc.ABC):
    """How a round's tensors are averaged across the workers of a run."""

    simulated = False  # True for the simulator: its round times are modelled, not measured
    averages_in_background = False  # True where averaging happens elsewhere (a process, a collective library)

    @abc.abstractmethod
    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        """Replace ``tensors`` in place by their ``weight``-weighted mean over the workers of round
        ``round_index``, sent compressed by the backend's codec (see ``reduce.average_payloads``). Every
        worker that took part ends with bit-identical tensors. On failure the tensors are left as
        they were and the result says so. ``fragment`` names which of the parameter fragments
        given to ``build_backend`` the tensors are (streaming syncs them separately)."""

    def staging(self, fragment: int = 0) -> contextlib.AbstractContextManager[Sequence[torch.Tensor] | None]:
        """The buffers this transport averages ``fragment`` in, held while the caller writes its
        contribution into them (``OuterStep`` forms its pseudo-gradient there): handed back as
        ``Staged``, nothing is copied on the way in or out, and no second whole copy of the params
        is held beside them. None (the default): the transport averages the caller's own tensors."""
        return contextlib.nullcontext(None)

    def start_all_reduce(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> PendingAverage:
        """``all_reduce_mean``, started now and finished by ``PendingAverage.wait()``; inner steps can
        run in between. Transports whose averaging happens elsewhere (``averages_in_background``:
        hivemind's averager process, torch.distributed) run it on a thread that only waits; the
        simulator runs it at once, and its modelled time says what overlapping it would have hidden.
        The trainer starts at most one at a time, so torch.distributed's collectives never interleave."""

        def run() -> SyncResult:
            return self.all_reduce_mean(
                tensors, weight, round_index=round_index, deadline_s=deadline_s, fragment=fragment
            )

        return PendingAverage.in_background(run) if self.averages_in_background else PendingAverage.finished(run())


class StateExchange:
    """A worker's state offered to peers that missed a round or join late, and taken from them."""

    def publish_state(self, round_index: int, rank: StateRank, state: StateReader) -> None:  # noqa: B027
        """Offer the worker's state after round ``round_index`` (ranked by ``rank``) to peers that
        missed the round or join late. ``state(use)`` calls ``use`` with the live state under the
        lock outer steps take, or returns None once an outer step changed it (the offer is stale):
        a transport reads it only when a peer asks, so nothing is copied or serialized on the
        outer step's path (``OuterStep.offered_state``)."""

    def fetch_state(
        self,
        round_index: int,
        *,
        better_than: StateRank,
        timeout_s: float,
        newer: bool = False,
        check: StateCheck | None = None,
    ) -> PeerState | None:
        """A peer's state after round ``round_index`` ranked above ``better_than``, or (``newer``)
        after any later round, the newest and best first; None if no such peer answers within
        ``timeout_s``. A state that ``check`` refuses is not taken: the peer that served it is
        named in the log and the next offer is tried; one it cannot tell yet is asked for again."""
        return None

    def sole_state_source(self) -> bool:
        """Whether no other worker of the run could hold a state to take or to compare with: every
        other live one takes states and serves none (clients), and none that served is missing (it
        may train on apart). A worker whose round failed is then the one the others take their state
        from, in step with them, not unsynced (core/recovery.py). False where it is not known."""
        return False


class Membership:
    """Who is in the run, and what each worker tells the others about itself."""

    def expected_peers(self) -> int | None:
        """How many workers a round should expect now (transports that track who is alive);
        None = the planned ``worker.count``."""
        return None

    def report_progress(self, round_index: int, step: int, stats: dict | None = None) -> None:  # noqa: B027
        """Rounds completed and inner steps done, for peers deciding where a newcomer starts, and
        (when given) the worker's latest figures for ``diloco status``. Optional."""

    def report_phase(self, phase: str, since: float) -> None:  # noqa: B027 - optional
        """What the worker is doing now (``watchdog.py``) and since when (``time.time()``), for ``diloco
        status``. Optional."""

    def announce_run(self, identity: dict) -> None:  # noqa: B027 - optional
        """The settings every worker of the run must share (``joining.run_identity``), published so
        that a newcomer can check its own before it downloads anything. Optional."""

    def declare_params(self, rounds_done: int, digest: str, *, peers: int) -> None:  # noqa: B027 - optional
        """Tell the run at once the digest of the params after round ``rounds_done``, which every worker
        of one model holds alike (blocking rounds), and the workers that round counted (``peers``):
        a worker checking a state of that round reads the two together (``declared_params``,
        core/recovery.py), also after the run's last round; a group compares digests to tell a split
        run met again, ``diloco status`` shows one. Optional."""

    def live_workers(self) -> dict[int, LiveWorker]:
        """The live workers by index (transports that track who is alive)."""
        return {}

    def declared_params(self) -> dict[int, Declared]:
        """What each other live worker last declared of its params, by worker index; {} where not known."""
        return {}

    def leave(self) -> None:  # noqa: B027 - optional
        """Tell the peers this worker is leaving, so that no round waits for it."""

    @property
    def addresses(self) -> list[str]:
        """Addresses other workers can join this one with (empty when not networked)."""
        return []


class LossBoard(abc.ABC):
    """Held-out losses the workers that hold the same params share, batch by batch, so that each
    evaluates only its share of the batches (core/shared_evaluation.py). Reads are never trusted
    further than the transport trusts its peers: a transport offers one only where they are trusted."""

    wait_s = 1.0  # how long a publication may take to be read by the others, beyond their own work

    @abc.abstractmethod
    def publish(self, key: str, worker: int, losses: dict[int, float]) -> None:
        """Offer ``losses`` (a held-out batch's index -> its loss) under ``key`` as worker ``worker``'s,
        replacing what it offered there before. A publication that fails is logged, never raised."""

    @abc.abstractmethod
    def read(self, key: str) -> dict[int, float]:
        """Every loss published under ``key``, by batch index; {} when none was, or none answered."""


class CommBackend:
    """A transport, in its parts: ``averaging`` (every transport has one), ``states`` and
    ``membership`` (hivemind serves both; elsewhere they are the do-nothing defaults above), and
    ``board``, the held-out losses shared among its workers (None where not offered). A wrapper
    that changes one part builds a view with ``with_parts`` (fault injection changes the
    averaging); a transport with resources to release overrides ``finish`` and ``shutdown``."""

    def __init__(
        self,
        averaging: Averaging,
        *,
        states: StateExchange | None = None,
        membership: Membership | None = None,
        board: LossBoard | None = None,
    ):
        self.averaging = averaging
        self.states = states if states is not None else StateExchange()
        self.membership = membership if membership is not None else Membership()
        self.board = board

    def with_parts(self, **parts: Averaging | StateExchange | Membership | LossBoard | None) -> CommBackend:
        """This transport with some of its parts replaced (``averaging=``, ``states=``, ``membership=``,
        ``board=``); its end is still this transport's."""
        unknown = set(parts) - {"averaging", "states", "membership", "board"}
        if unknown:
            raise TypeError(f"a transport has no part {', '.join(sorted(unknown))}")
        current = {"averaging": self.averaging, "states": self.states, "membership": self.membership}
        return _WithParts(self, **{**current, "board": self.board, **parts})

    def finish(self) -> None:  # noqa: B027 - optional
        """Training is over: stay reachable as long as a peer may still need this worker's state."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release sockets and background processes. Safe to call twice."""

    def __enter__(self) -> CommBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


class _WithParts(CommBackend):
    """``CommBackend.with_parts``: other parts, the same transport underneath; ending it ends that one."""

    def __init__(
        self,
        underneath: CommBackend,
        *,
        averaging: Averaging,
        states: StateExchange,
        membership: Membership,
        board: LossBoard | None,
    ):
        super().__init__(averaging, states=states, membership=membership, board=board)
        self._underneath = underneath

    def finish(self) -> None:
        self._underneath.finish()

    def shutdown(self) -> None:
        self._underneath.shutdown()


class PendingAverage:
    """An all-reduce in flight; ``wait()`` blocks until it is done, or at most ``timeout_s``, and
    returns its result."""

    def __init__(self, run: Callable[[], SyncResult] | None = None, *, result: SyncResult | None = None):
        self._result = result
        self._error: BaseException | None = None
        self._thread = None
        if run is not None:
            self._thread = threading.Thread(target=self._run, args=(run,), name="diloco-average", daemon=True)
            self._thread.start()

    @classmethod
    def finished(cls, result: SyncResult) -> PendingAverage:
        return cls(result=result)

    @classmethod
    def in_background(cls, run: Callable[[], SyncResult]) -> PendingAverage:
        return cls(run)

    def _run(self, run: Callable[[], SyncResult]) -> None:
        try:
            self._result = run()
        except BaseException as error:  # handed to the thread that waits
            self._error = error

    def wait(self, timeout_s: float | None = None) -> SyncResult:
        """The result; a failed one (our own tensors left in place) when none came within ``timeout_s``.
        The abandoned average keeps its thread until the transport gives up on it; the transport
        refuses a new average of the same tensors meanwhile (``HivemindAveraging``)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self.abandoned:
                return SyncResult(
                    Outcome.FAILED, 1, 0.0, error=f"no result within {timeout_s:.0f} s: the average was abandoned"
                )
        if self._error is not None:
            raise self._error
        return self._result

    @property
    def abandoned(self) -> bool:
        """Still running after a ``wait`` gave up on it: it may yet write into its tensors."""
        return self._thread is not None and self._thread.is_alive()
