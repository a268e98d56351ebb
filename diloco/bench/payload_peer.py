"""One of the two peers of ``diloco bench scale``'s baselines: a synthetic fp32 payload averaged
with one other peer on 127.0.0.1 through stock hivemind or through torch.distributed gloo.

    python -m diloco.bench.payload_peer --kind hivemind --rank 0 --values 800000 --rounds 3 --rendezvous DIR
    python -m diloco.bench.payload_peer --kind gloo --rank 1 --values 800000 --rounds 3 --rendezvous DIR

``hivemind``: a DHT each (rank 1's bootstrapped from rank 0's, whose addresses it reads from
``DIR``) and a ``hivemind.averaging.DecentralizedAverager`` with its defaults but for
``target_group_size=2``, so a round starts as soon as both are in (as ours does) instead of
after hivemind's 5 s ``min_matchmaking_time``; ``averager.step()`` ``--rounds`` times.
``gloo``: ``init_process_group("gloo")`` through a ``FileStore`` in ``DIR``, then ``all_reduce``
and a division by 2 ``--rounds`` times. Prints one JSON line: ``{"kind", "rank", "round_s": [...],
"ok": [...]}``, each round's seconds on this peer and whether it averaged with the other.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path

import torch

POLL_S = 0.2


def wait_for_file(path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
        time.sleep(POLL_S)
    return path.read_text()


def publish(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a reader polls for it)."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)


def hivemind_round_times(rank: int, tensor: torch.Tensor, rounds: int, rendezvous: Path, timeout_s: float):
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    addresses = rendezvous / "hivemind-rank0.json"
    initial_peers = json.loads(wait_for_file(addresses, timeout_s)) if rank else []
    dht = hivemind.DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        if rank == 0:
            publish(addresses, json.dumps([str(address) for address in dht.get_visible_maddrs()]))
        averager = DecentralizedAverager([tensor], dht, start=True, prefix="bench_scale", target_group_size=2)
        try:
            times, ok = [], []
            for _ in range(rounds):
                started = time.perf_counter()
                gathered = averager.step(timeout=timeout_s)
                times.append(time.perf_counter() - started)
                ok.append(gathered is not None and len(gathered) == 2)
            # neither leaves before the other has its last round's parts
            publish(rendezvous / f"hivemind-done-{rank}", "")
            wait_for_file(rendezvous / f"hivemind-done-{1 - rank}", timeout_s)
            return times, ok
        finally:
            averager.shutdown()
    finally:
        dht.shutdown()


def gloo_round_times(rank: int, tensor: torch.Tensor, rounds: int, rendezvous: Path, timeout_s: float):
    import torch.distributed as dist

    store = f"file://{(rendezvous / 'gloo-store').resolve()}"  # a relative path would read as a host
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s))
    try:
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            dist.all_reduce(tensor)
            tensor.div_(2)
            times.append(time.perf_counter() - started)
        dist.barrier()
        return times, [True] * rounds
    finally:
        dist.destroy_process_group()


ROUND_TIMES = {"hivemind": hivemind_round_times, "gloo": gloo_round_times}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=sorted(ROUND_TIMES), required=True)
    parser.add_argument("--rank", type=int, choices=(0, 1), required=True)
    parser.add_argument("--values", type=int, required=True, help="fp32 values in the payload")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rendezvous", type=Path, required=True, help="a folder both peers see, fresh")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound of each wait")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    torch.set_num_threads(1)

    tensor = torch.randn(args.values)
    times, ok = ROUND_TIMES[args.kind](args.rank, tensor, args.rounds, args.rendezvous, args.timeout_s)
    print(json.dumps({"kind": args.kind, "rank": args.rank, "round_s": times, "ok": ok}), flush=True)


if __name__ == "__main__":
    main()
