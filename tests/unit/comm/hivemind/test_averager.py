"""How long a part for a group we do not know waits for us to register it."""

from __future__ import annotations

import asyncio
import time

from diloco.comm.hivemind.averager import group_registered


async def _registered_after(delay_s: float, *, joining: bool, group: bytes = b"ours") -> tuple[bool, float]:
    """Our averager registers ``group`` after ``delay_s`` (hivemind's event set): whether a part
    for the group b"ours", asked with a 0.2 s bound, is taken, and after how long."""
    running: dict = {}
    registered = asyncio.Event()  # cleared: we are matchmaking

    async def register() -> None:
        await asyncio.sleep(delay_s)  # the matchmaking's outcome, scripted
        running[group] = asyncio.get_running_loop().create_future()
        registered.set()

    started = time.monotonic()
    task = asyncio.create_task(register())
    taken = await group_registered(b"ours", running, registered, 0.2, joining=lambda: joining)
    task.cancel()
    return taken, time.monotonic() - started


def test_a_part_for_a_group_we_may_still_register_waits_and_one_we_left_is_refused_at_the_bound():
    assert asyncio.run(_registered_after(0.05, joining=False))[0]  # the leader's answer was late: taken
    # past the bound, still following a leader (its answer on its way): taken once registered
    taken, waited = asyncio.run(_registered_after(0.6, joining=True))
    assert taken and waited >= 0.6
    # past the bound, following nobody (we gave up on that leader): refused at the bound
    taken, waited = asyncio.run(_registered_after(5.0, joining=False))
    assert not taken and 0.2 <= waited < 1.0
    # another group registered: refused as soon as it is
    taken, waited = asyncio.run(_registered_after(0.05, joining=True, group=b"another"))
    assert not taken and waited < 0.2
