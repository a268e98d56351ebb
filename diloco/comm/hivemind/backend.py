"""The hivemind transport of one worker, composed of its parts:

- ``peer.py``            its DHT peer: start-up, reachability and client mode, bounded DHT calls
- ``membership.py``      its roster record and its view of who is live (``roster.py``)
- ``averaging.py``       a round's averaging: one averager per fragment, the retry, the round
                         alone; one attempt in a group is ``group_round.py``
- ``state_exchange.py``  its state offered to peers and taken from them (``state_offers.py``);
                         in a run of clients, through a helper (``state_relay.py``)
- ``redial.py``          its peers found again after the network between them healed
- ``loss_board.py``      the held-out losses the workers holding the same params share

With a run key (``run_key.py``) only key holders can write the run's DHT records, join its groups
or download its state (``state_access.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from diloco.comm.base import CommBackend
from diloco.comm.config import CommConfig
from diloco.comm.hivemind.averaging import HivemindAveraging, start_averager, start_plane
from diloco.comm.hivemind.helper_record import RunHelpers
from diloco.comm.hivemind.loss_board import DHTLossBoard
from diloco.comm.hivemind.membership import HivemindMembership
from diloco.comm.hivemind.peer import Peer
from diloco.comm.hivemind.redial import Redial, redial_every_s
from diloco.comm.hivemind.roster import Roster
from diloco.comm.hivemind.state_access import say_if_open
from diloco.comm.hivemind.state_exchange import HivemindStateExchange
from diloco.comm.hivemind.state_offers import StateOffers
from diloco.comm.hivemind.state_relay import StateUploader, StateWants
from diloco.comm.run_key_env import resolve_run_key
from diloco.compression import Codec

logger = logging.getLogger(__name__)


def flat_views(templates: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One flat fp32 buffer for tensors shaped like ``templates``, and views of it in their shapes
    (the data plane reduces the buffer whole)."""
    flat = torch.zeros(sum(t.numel() for t in templates), dtype=torch.float32)
    views = [view.view(t.shape) for view, t in zip(flat.split([t.numel() for t in templates]), templates)]
    return flat, views


class HivemindBackend(CommBackend):
    """One worker's DHT peer, averagers, state exchange and roster record. ``templates`` fix the
    shapes of what is averaged; ``fragments`` (lists of indices into ``templates``) get one averager
    each, so that streaming can average one fragment while another trains (default: one fragment
    of everything). ``num_workers`` is the planned size of the run; ``worker_index`` keys this
    worker's roster record."""

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
        state_dir: Path | None = None,
    ):
        fragments = [list(indices) for indices in fragments or [range(len(templates))]]
        self.peer = peer = Peer(cfg.hivemind, run_key=cfg.run_key)
        plane = start_plane(cfg.hivemind, peer, deadline_s=cfg.deadline_s)
        layout = [[tuple(templates[i].shape) for i in indices] for indices in fragments]
        roster = _roster(cfg, peer, worker_index=worker_index, planned=num_workers, slots=slots, layout=layout)
        self._roster = roster
        averagers, flats = [], []
        self._uploader = None
        try:  # should a part not start, what started is stopped again
            started = _started_averagers(cfg, peer, templates, fragments, codec, num_workers, state_dir=state_dir)
            for flat, averager in started:
                flats.append(flat)
                averagers.append(averager)
            roster.start()
            membership = HivemindMembership(roster, peer, num_workers=num_workers)
            helpers = RunHelpers(peer.call, cfg.run_id)  # who joins each round's group to reduce
            offers = StateOffers(peer.call, f"{averagers[0].prefix}.all_averagers", peer.peer_id.to_bytes())
            wants = StateWants(peer.call, cfg.run_id, str(peer.peer_id)) if peer.client_mode else None
            # the first fragment's averager also serves the worker's state: to key holders only, if keyed
            if not peer.client_mode:
                say_if_open(resolve_run_key(cfg.run_key), who="worker", what="its params")
            states = _state_exchange(cfg, peer, roster, averagers[0], offers, wants, helpers, num_workers=num_workers)
            self._uploader = _start_uploader(cfg, peer, roster, wants, offers, states) if wants else None
            averaging = HivemindAveraging(
                cfg,
                peer=peer,
                roster=roster,
                offers=offers,
                codec=codec,
                averagers=averagers,
                flats=flats,
                plane=plane,
                num_workers=num_workers,
                membership=membership,
                states=states,
                helpers=helpers,
            )
        except BaseException:
            _shut_down(roster, plane, averagers, peer, self._uploader)
            raise
        board = None  # an untrusted peer could publish any loss: workers then evaluate every batch themselves
        if cfg.trust in ("trusted", ""):  # "": a CommConfig built by hand, not resolved by load_config
            board = DHTLossBoard(peer.call, run_id=cfg.run_id, wait_s=cfg.hivemind.request_timeout_s)
        super().__init__(averaging, states=states, membership=membership, board=board)
        self._closed = False

    def finish(self) -> None:
        self.averaging.finish()
        self.states.linger()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        _shut_down(self._roster, self.averaging.plane, self.averaging.averagers, self.peer, self._uploader)


def _started_averagers(
    cfg: CommConfig,
    peer: Peer,
    templates: Sequence[torch.Tensor],
    fragments: list[list[int]],
    codec: Codec,
    num_workers: int,
    *,
    state_dir: Path | None,
) -> Iterator[tuple[torch.Tensor, object]]:
    """Each fragment's flat buffer and its averager, started one after the other (should one not
    start, the caller stops those started before it)."""
    for fragment, indices in enumerate(fragments):
        flat, views = flat_views([templates[i] for i in indices])
        yield (
            flat,
            start_averager(
                cfg, peer, views, codec=codec, fragment=fragment, num_workers=num_workers, state_dir=state_dir
            ),
        )


def _state_exchange(
    cfg: CommConfig,
    peer: Peer,
    roster: Roster,
    server,
    offers: StateOffers,
    wants: StateWants | None,
    helpers: RunHelpers,
    *,
    num_workers: int,
) -> HivemindStateExchange:
    """The worker's state offered to peers and taken from them; ``server``: the averager that serves it."""
    return HivemindStateExchange(
        server=server,
        offers=offers,
        roster=roster,
        num_workers=num_workers,
        client_mode=peer.client_mode,
        linger_s=cfg.hivemind.matchmaking_s,
        wants=wants,
        helpers=helpers,
    )


def _start_uploader(
    cfg: CommConfig, peer: Peer, roster: Roster, wants: StateWants, offers: StateOffers, states: HivemindStateExchange
) -> StateUploader:
    """A client's uploader: a client asks for a state through the run's helpers (``wants``), and
    uploads its own to one for a worker that asks (state_relay.py)."""
    uploader = StateUploader(
        peer.call,
        cfg.run_id,
        wants=wants,
        offers=offers.read,
        published=states.published_state,
        helpers=RunHelpers(peer.call, cfg.run_id),
        no_server=roster.no_server_seen,
        timeout_s=cfg.deadline_s,
    )
    uploader.start()
    return uploader


def _roster(cfg: CommConfig, peer: Peer, *, worker_index: int, planned: int, slots: int, layout: list) -> Roster:
    """This worker's roster record, not started yet, and its heartbeat's chores: answering others'
    dial-back requests (a peer that can be dialled) and dialling missing workers again."""
    roster = Roster(
        peer.call,
        run_id=cfg.run_id,
        worker_index=worker_index,
        planned=planned,
        slots=slots,
        serves_state=not peer.client_mode,
        addresses=[] if peer.client_mode else peer.visible_addresses,
        peer_id=str(peer.peer_id),
        heartbeat_s=cfg.hivemind.heartbeat_s,
        layout=layout,
        chores=[] if peer.client_mode else [peer.answer_dialbacks],
    )
    every_s = redial_every_s(roster.heartbeat_s)
    roster.chores.append(Redial(peer.send, roster, cfg.hivemind.initial_peers, every_s=every_s))
    return roster


def _shut_down(roster: Roster, plane, averagers: Sequence, peer: Peer, uploader: StateUploader | None) -> None:
    """Stop the heartbeat and the state uploader, then the data plane, the averagers and the DHT peer."""
    roster.stop()
    if uploader is not None:
        uploader.close()
    if plane is not None:
        plane.close()
    for part in (*averagers, peer):
        try:
            part.shutdown()
        except Exception:  # shutting down a half-dead daemon must not hide the real error
            logger.debug("error while shutting down %s", part, exc_info=True)
