"""What a worker sends in a round: the payload model the simulator's link model and the
adaptive codec's choice (link_meter.py) share."""

from __future__ import annotations


def sent_bytes(payload_bytes: int, num_workers: int, *, gathers: bool = False) -> int:
    """What each of ``num_workers`` sends (and receives) in a round of ``payload_bytes`` each: in
    hivemind's butterfly (n-1)/n of the payload to the reducers and as much back as averages;
    for a codec that ``gathers``, its payload to each of the others (comm/hivemind/gathered.py)."""
    if num_workers <= 1:
        return 0
    if gathers:
        return (num_workers - 1) * payload_bytes
    return int(2 * (num_workers - 1) / num_workers * payload_bytes)
