"""Transports for the outer sync. ``build_backend`` picks one from ``comm.backend``.

- ``base.py``            the interfaces: ``Averaging``, ``StateExchange``, ``Membership``, and
                         ``CommBackend``, a transport as those parts; ``SyncResult``
- ``round_result.py``    what a round produced: its ``Outcome`` and the ``SyncResult`` carrying it
- ``config.py``          ``CommConfig``, the ``comm:`` section (each transport's own settings nested in it)
- ``members.py``         who is live, as a transport's membership shows it to the worker (``LiveWorker``)
- ``reduce.py``          the reduce rule every transport follows (``average_payloads``)
- ``hivemind/``          P2P over a DHT, the production path: its peer, a round's averaging, the
                         state exchange, the roster, the bit-identical averager, the gloo data
                         plane, reachability, the run key; its settings (``settings.py``, ``comm.hivemind``)
- ``simulator.py``       M simulated workers in one process, with a link model
- ``torchdist.py``       torch.distributed all-reduce under torchrun (datacenter runs)
- ``sites.py``           a site: several torchrun ranks as one worker, data-parallel inside; its
                         leader (or, sharded, every rank) syncs across sites over the transport
- ``robust.py``          which contributions a round keeps (norm far above the median: dropped) and their scale
- ``sketch.py``          a contribution's sketch: 2,048 numbers whose cosines are the whole vectors'
- ``verdicts.py``        verdicts on whole contributions from their declared sketches (direction, replays)
- ``run_key_env.py``     where the run key comes from (``comm.run_key``, ``$DILOCO_RUN_KEY``)
- ``scores.py``          each worker's standing across rounds, and who is excluded (``comm.exclude_after``)
- ``bounds.py``          the bound of every wait of a round
- ``link_meter.py``      a worker's measure of its link, and the codec it prefers next round (adaptive)
- ``volume.py``          the bytes a round moves, by codec and group size
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from diloco.comm.base import CommBackend, SyncResult
from diloco.comm.config import CommConfig
from diloco.compression import Codec, NoCompression

BACKENDS = ("hivemind", "simulator", "torchdist")
DATA_PLANES = ("hivemind", "gloo")  # comm.hivemind.data_plane (hivemind/gloo_plane.py)

__all__ = ["BACKENDS", "DATA_PLANES", "CommBackend", "CommConfig", "SyncResult", "build_backend"]


def build_backend(
    cfg: CommConfig,
    *,
    templates: Sequence[torch.Tensor],
    num_workers: int,
    worker_index: int,
    device: torch.device | None = None,
    codec: Codec | None = None,
    fragments: Sequence[Sequence[int]] | None = None,
    slots: int = 0,
    state_dir: Path | None = None,
) -> CommBackend:
    """Build the transport named by ``cfg.backend`` for tensors shaped like ``templates``, sending
    them compressed by ``codec`` (default: fp32 as it is). ``fragments`` (lists of indices into
    ``templates``) are the groups of tensors averaged separately (default: all of them at once).
    ``slots``: the run's data shards, the most workers it can hold (default ``num_workers``).
    ``state_dir``: where a transport keeps what must outlive the process (hivemind: its standings
    of the other peers, ``comm.exclude_after``)."""
    codec = codec or NoCompression()
    if cfg.backend == "torchdist":
        from diloco.comm.torchdist import TorchDistBackend

        return TorchDistBackend(
            cfg, num_workers=num_workers, worker_index=worker_index, device=device or torch.device("cpu"), codec=codec
        )
    if cfg.backend == "simulator":
        from diloco.comm.simulator import SimulatedBackend

        return SimulatedBackend(cfg, num_workers=num_workers, worker_index=worker_index, codec=codec)
    if cfg.backend == "hivemind":
        from diloco.comm.hivemind.backend import HivemindBackend

        return HivemindBackend(
            cfg,
            templates=templates,
            num_workers=num_workers,
            codec=codec,
            fragments=fragments,
            worker_index=worker_index,
            slots=slots,
            state_dir=state_dir,
        )
    raise ValueError(f"comm.backend={cfg.backend!r} is not one of {', '.join(BACKENDS)}")
