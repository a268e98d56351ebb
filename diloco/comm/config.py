"""The transport's settings: ``CommConfig``, the ``comm:`` section. Each transport's own settings
are nested in it and live beside that transport (``comm.hivemind``: hivemind/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco.comm.hivemind.settings import HivemindConfig


@dataclass
class CommConfig:
    """``comm``: the transport, the run it joins, the bounds of a round and what a round screens out."""

    backend: str = "hivemind"  # transport: hivemind (P2P over a DHT) / simulator (M workers in one process) / torchdist
    run_id: str = "diloco"  # name of the run on the DHT; peers of another run id never average together
    run_key: str = ""  # shared secret: only peers holding it join the run ("" = open; or $DILOCO_RUN_KEY)
    deadline_s: float = 60.0  # a round gives up on peers that have not arrived after this many seconds
    bandwidth_mbps: float = 0.0  # link rate each way: the simulator models it; hivemind reduces less if slow; 0 unknown
    latency_ms: float = 0.0  # the simulator's link model: one-way latency added to each phase of a round
    trust: str = ""  # who the workers are: trusted / open / keyed (key required); "" = open where others reach it
    max_norm_ratio: float = 10.0  # drop a contribution whose norm is above this x the round's median norm; 0 = off
    clip_to_median: bool = False  # scale every kept contribution above the round's median norm down to it (comm.trust)
    max_weight_ratio: float = 4.0  # at most this x the round's median weight (more for sites of many ranks); 0 = off
    min_cosine: float = -1.0  # drop a contribution whose cosine to the others' median is below this; -1 off
    exclude_after: int = 3  # a worker left out of this many rounds in a row is left out of the later ones; 0 = never
    readmit_after: int = 20  # an excluded worker is back on probation after this many rounds (x 2 each time); 0 = never
    hivemind: HivemindConfig = field(default_factory=HivemindConfig)  # the hivemind transport's own settings
