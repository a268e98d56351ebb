"""Averaging over hivemind: a DHT to find the run's peers, a butterfly all-reduce to average.

Each round is matched under its own DHT key (run id + round number), so a worker that is a
round behind never averages with the others' newer pseudo-gradients. Rounds wait up to
``comm.matchmaking_s`` for the whole expected group and start at once when it is full.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable, Sequence

import torch

from diloco.comm.base import (
    CommBackend,
    CommConfig,
    CommError,
    Contribution,
    SyncResult,
    average_payloads,
)
from diloco.comm.robust import declared_norm, norm_of, screen
from diloco.compression import Codec

logger = logging.getLogger(__name__)

_ROUND_BITS = 16  # rounds are keyed modulo 2**16 on the DHT: far more than any peer can lag


def round_group_bits(round_index: int) -> str:
    """The hivemind group bits that key a round's matchmaking on the DHT."""
    return format(round_index % (1 << _ROUND_BITS), f"0{_ROUND_BITS}b")


def start_dht(cfg: CommConfig, *, initial_peers: Sequence[str] | None = None):
    """Start a DHT peer listening as ``cfg`` says (the bootstrap peer uses this too)."""
    import hivemind

    peers = list(cfg.initial_peers if initial_peers is None else initial_peers)
    announce = [f"/ip4/{cfg.announce_host}/tcp/{cfg.port}"] if cfg.announce_host and cfg.port else None
    try:
        return hivemind.DHT(
            initial_peers=peers,
            host_maddrs=[f"/ip4/{cfg.host}/tcp/{cfg.port}"],
            announce_maddrs=announce,
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


def visible_addresses(dht) -> list[str]:
    return [str(address) for address in dht.get_visible_maddrs()]


class HivemindBackend(CommBackend):
    """One worker's DHT peer and averager. ``templates`` fix the shapes of what is averaged;
    ``fragments`` (lists of indices into ``templates``) get one averager each, so that streaming
    can average one fragment while another trains (default: one fragment of everything)."""

    averages_in_background = True  # the averager process does the work

    def __init__(
        self,
        cfg: CommConfig,
        *,
        templates: Sequence[torch.Tensor],
        num_workers: int,
        codec: Codec,
        fragments: Sequence[Sequence[int]] | None = None,
    ):
        self.cfg, self.codec = cfg, codec
        self.num_workers = num_workers
        self._closed = False
        self._averagers = []
        self._dht = start_dht(cfg)
        fragments = fragments or [range(len(templates))]
        try:
            for fragment, indices in enumerate(fragments):
                self._averagers.append(self._start_averager([templates[i] for i in indices], fragment))
        except BaseException:
            self.shutdown()
            raise
        self._published: tuple[int, int] | None = None  # (round, peers) of the state we offer

    def _start_averager(self, templates: Sequence[torch.Tensor], fragment: int):
        from diloco.comm.exact_averager import ExactAverager

        cfg = self.cfg
        return ExactAverager(
            [torch.zeros_like(t, dtype=torch.float32, device="cpu") for t in templates],
            self._dht,
            codec=self.codec,
            max_norm_ratio=cfg.max_norm_ratio,
            clip_to_median=cfg.clip_to_median,
            start=True,
            prefix=f"{cfg.run_id}_avg" + (f"_f{fragment}" if fragment else ""),
            target_group_size=self.num_workers,
            min_group_size=2,
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
        return visible_addresses(self._dht)

    def all_reduce_mean(
        self, tensors: Sequence[torch.Tensor], weight: float, *, round_index: int, deadline_s: float, fragment: int = 0
    ) -> SyncResult:
        if self.num_workers <= 1:  # nobody to talk to, but the result is what the codec makes of it, as always
            alone = [Contribution("self", [self.codec.compress(t) for t in tensors], weight)]
            means, used = average_payloads(self.codec, alone, [t.numel() for t in tensors], round_index=round_index)
            if not used:
                return SyncResult(False, 1, weight, error="our own contribution was dropped")
            for tensor, mean in zip(tensors, means):
                tensor.copy_(mean.view_as(tensor))
            return SyncResult(ok=True, peers=1, total_weight=weight)
        averager = self._averagers[fragment]
        averager.set_group_bits(round_group_bits(round_index))
        sent_before, recv_before, failed_before = averager.traffic.read()
        with averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, tensors):
                buffer.copy_(tensor)
        # the norm of what the reducers will decode, declared so that each can screen whole vectors (robust.py)
        norm = norm_of(tensors if self.codec.lossless else [self.codec.restore(t) for t in tensors])
        try:
            gathered = averager.step(weight=weight, gather={"weight": weight, "norm": norm}, timeout=deadline_s)
        except Exception as error:  # hivemind raises a zoo of errors; a failed round is a result
            gathered, failure = None, f"{type(error).__name__}: {error}"
        else:
            failure = "" if gathered is not None else "no group found before the deadline"
        sent, recv, failed = averager.traffic.read()
        sent, recv, failed_values = sent - sent_before, recv - recv_before, failed - failed_before
        if failure:
            return SyncResult(False, 1, weight, sent, recv, error=failure)
        if failed_values:
            # some reducer dropped out: part of the buffers hold our own values, not the mean
            return SyncResult(False, 1, weight, sent, recv, error=f"{failed_values} values were not averaged")
        with averager.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, tensors):
                tensor.copy_(buffer)
        # the peers whose contribution is in the mean: those the screening kept (every peer screens alike)
        kept = screen(
            {peer: declared_norm(g) for peer, g in gathered.items()},
            max_norm_ratio=self.cfg.max_norm_ratio,
            clip_to_median=self.cfg.clip_to_median,
        ).scales
        total_weight = sum(float(g.get("weight", 0.0)) for peer, g in gathered.items() if peer in kept)
        return SyncResult(True, len(kept), total_weight, sent, recv)

    def publish_state(self, round_index: int, peers: int, state: Callable[[], dict]) -> None:
        self._published = (round_index, peers)
        buffer = io.BytesIO()
        torch.save(state(), buffer)
        # peers look for the newest round first, then the biggest group that averaged it
        self._averager.share_state(
            {"round": round_index, "peers": peers}, buffer.getvalue(), priority=round_index * 1000.0 + peers
        )

    def fetch_state(self, round_index: int, *, min_peers: int, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            offers = self._state_offers()
            if any(r == round_index and p >= min_peers for r, p in offers):
                found = self._averager.load_state_from_peers(timeout=max(1.0, deadline - time.monotonic()))
                if found is not None:
                    metadata, tensors = found
                    if metadata.get("round") == round_index and metadata.get("peers", 0) >= min_peers and tensors:
                        return torch.load(io.BytesIO(tensors[0].numpy().tobytes()), weights_only=True)
            elif offers and all(r >= round_index for r, _ in offers):
                return None  # every live peer has finished this round, and none averaged over more
            # the others may still be finishing this round's outer step: ask again shortly
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return None

    def finish(self) -> None:
        # after the last round nobody would serve a peer that lost part of it: linger while a live
        # peer offers a worse state of that round (it is fetching ours), at most comm.matchmaking_s
        if self._published is None:
            return
        last_round, peers = self._published
        deadline = time.monotonic() + self.cfg.matchmaking_s
        while time.monotonic() < deadline and any(r == last_round and p < peers for r, p in self._state_offers()):
            time.sleep(0.5)

    def _state_offers(self) -> list[tuple[int, int]]:
        """(round, peers) of the state each other live peer offers, from the priorities it declares on the DHT."""
        entry = self._dht.get(f"{self._averager.prefix}.all_averagers", latest=True)
        if entry is None or not isinstance(entry.value, dict):
            return []
        offers, own = [], self._dht.peer_id.to_bytes()
        for subkey, declared in entry.value.items():
            if subkey == own:
                continue
            priority = getattr(declared, "value", None)
            if isinstance(priority, int | float) and priority > 0:
                offers.append((int(priority // 1000), int(priority % 1000)))
        return offers

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for part in (*self._averagers, self._dht):
            try:
                part.shutdown()
            except Exception:  # shutting down a half-dead daemon must not hide the real error
                logger.debug("error while shutting down %s", part, exc_info=True)
