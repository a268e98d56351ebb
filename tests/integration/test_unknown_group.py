"""A real averager asked to reduce a part for a group it is not in: it refuses within a bound.

A leader can count a follower in a group the follower had already given up on (the leader's
answer came past the follower's request timeout); the follower looks for a group again, and the
group's senders ask it for its share. It must say the group is not its own at once, or every
sender waits its whole reducer timeout for a share nobody reduces.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from diloco.compression import CompressionConfig, build_codec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REQUEST_TIMEOUT_S = 1.0


async def _ask_for_a_share(addresses: list, peer_id, prefix: str, timeout_s: float):
    """Send ``peer_id`` a part for a group it never heard of; its first reply's code, or None."""
    from hivemind.p2p import P2P
    from hivemind.proto import averaging_pb2
    from hivemind.utils.asyncio import as_aiter

    from diloco.comm.hivemind.averager import ExactAverager

    p2p = await P2P.create(initial_peers=addresses)
    try:
        stub = ExactAverager.get_stub(p2p, peer_id, namespace=prefix)
        request = averaging_pb2.AveragingData(
            code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"a group it is not in", weight=1.0
        )

        async def first_reply():
            async for reply in await stub.rpc_aggregate_part(as_aiter(request)):
                return reply.code
            return None

        return await asyncio.wait_for(first_reply(), timeout_s)
    finally:
        await p2p.shutdown()


def test_a_part_for_a_group_the_averager_is_not_in_is_refused_while_it_looks_for_a_group():
    import hivemind
    from hivemind.proto import averaging_pb2

    from diloco.comm.hivemind.averager import UNKNOWN_GROUP_WAIT, ExactAverager

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    averager = ExactAverager(
        [torch.zeros(16)],
        dht,
        codec=build_codec(CompressionConfig()),
        start=True,
        prefix="unknown_group_avg",
        target_group_size=2,
        min_group_size=2,
        min_matchmaking_time=30.0,  # nobody else comes: it looks for a group the whole test
        request_timeout=REQUEST_TIMEOUT_S,
        allreduce_timeout=30.0,
        shutdown_timeout=5,
    )
    step = averager.step(wait=False, timeout=60)
    try:
        deadline = time.monotonic() + 30
        while step.stage.name != "LOOKING_FOR_GROUP" and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the step's stage (shared memory) until matchmaking began
        assert step.stage.name == "LOOKING_FOR_GROUP", step.stage
        addresses = [str(a) for a in dht.get_visible_maddrs()]
        started = time.monotonic()
        # hivemind alone holds the part until the matchmaking ends (30 s and more): past 10 s, it held it
        code = asyncio.run(_ask_for_a_share(addresses, dht.peer_id, "unknown_group_avg", timeout_s=10))
        waited = time.monotonic() - started
        assert code == averaging_pb2.BAD_GROUP_ID, code
        assert waited >= UNKNOWN_GROUP_WAIT * REQUEST_TIMEOUT_S * 0.9, waited  # the leader's late answer had its time
        assert not step.done()  # it still looks for a group of its own: the round stops it (group_round.py)
        assert averager.traffic.groups_left_behind() == 1
    finally:
        step.cancel()
        averager.shutdown()
        dht.shutdown()
