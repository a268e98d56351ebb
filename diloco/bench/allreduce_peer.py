"""One peer of the all-reduce efficiency measurement (``diloco bench utilization``).

    python -m diloco.bench.allreduce_peer --peers ADDR --count 4 --host 10.231.7.10 \\
        --payload-mb 40 --rounds 3

Joins the DHT through ``--peers``, averages a synthetic fp32 payload with ``--count`` peers
through the very transport training uses (``HivemindBackend``) ``--rounds`` times, and prints
one JSON line: when each round started and ended on this peer (wall clock: every peer of the
measurement runs on one machine) and the bytes it sent.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from diloco.comm.config import CommConfig
from diloco.comm.hivemind.backend import HivemindBackend
from diloco.comm.hivemind.settings import HivemindConfig
from diloco.compression import NoCompression


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--payload-mb", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=300.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("hivemind").setLevel(logging.ERROR)

    values = int(args.payload_mb * 1e6 / 4)
    cfg = CommConfig(
        run_id="allreduce_efficiency",
        deadline_s=args.deadline_s,
        hivemind=HivemindConfig(
            initial_peers=[args.peers],
            host=args.host,
            matchmaking_s=60.0,  # a round starts as soon as all --count peers are in
            request_timeout_s=5.0,
            startup_timeout_s=120.0,
        ),
    )
    tensor = torch.randn(values)
    backend = HivemindBackend(cfg, templates=[tensor], num_workers=args.count, codec=NoCompression())
    starts, ends, sent, peers = [], [], [], []
    try:
        for round_index in range(args.rounds):
            starts.append(time.time())
            result = backend.averaging.all_reduce_mean(
                [tensor], 1.0, round_index=round_index, deadline_s=args.deadline_s
            )
            ends.append(time.time())
            sent.append(result.bytes_sent)
            peers.append(result.peers if result.ok else 0)
    finally:
        backend.shutdown()
    print(json.dumps({"starts": starts, "ends": ends, "bytes_sent": sent, "peers": peers}), flush=True)


if __name__ == "__main__":
    main()
