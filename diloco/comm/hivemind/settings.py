"""The hivemind transport's own settings (``comm.hivemind``), read by the transport and by the
tools that start hivemind peers. A plain dataclass: importing it starts nothing and loads no hivemind."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HivemindConfig:
    """``comm.hivemind``: what only the hivemind transport and the tools that start hivemind peers read."""

    initial_peers: list[str] = field(default_factory=list)  # multiaddrs of live peers; [] = start a new run
    host: str = "127.0.0.1"  # address to listen on (0.0.0.0 to accept peers from other machines)
    port: int = 0  # TCP port to listen on; 0 = any free port
    announce_host: str = ""  # address other peers should dial (public IP behind NAT); "" = the listen address
    client_mode: str = "auto"  # true: dial out only (reduces no part, serves no state); auto: when not dialable
    use_relay: bool = True  # libp2p circuit relay: reach peers behind NAT through other peers
    use_auto_relay: bool = False  # behind NAT: look for a relay to become reachable through
    matchmaking_s: float = 15.0  # a round starts at once when all workers are in; else after this many seconds
    request_timeout_s: float = 3.0  # one matchmaking request; keep below matchmaking_s (hivemind deadlocks)
    heartbeat_s: float = 3.0  # how often a worker renews its roster record; 4 missed: not waited for, 8: out of the run
    startup_timeout_s: float = 60.0  # p2pd start-up; loaded 2-core machines need more than hivemind's 15 s
    data_plane: str = "hivemind"  # hivemind; gloo: fp32 rounds among dialable peers through a gloo all-reduce
