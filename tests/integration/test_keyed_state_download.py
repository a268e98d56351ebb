"""In a keyed run a member serves its state only to a peer that proves it holds the run key. A
stranger that knows the member's address and asks for its state directly (the whole state as
hivemind asks for it, its manifest, its parts; with no proof, or one made with another key) gets
nothing, and the member logs one line naming it; a key holder downloads the state in parts, and
whole (as a helper serves a relayed state). Real averagers, each in its own process."""

from __future__ import annotations

import asyncio
import io
import logging
import time

import pytest
import torch

from diloco.comm.hivemind.peer import start_dht, visible_addresses
from diloco.comm.hivemind.settings import HivemindConfig
from diloco.comm.hivemind.state_access import REFUSED, StateAccess
from diloco.comm.hivemind.state_parts import manifest_of
from diloco.comm.hivemind.state_serving import serialize_state
from diloco.compression import CompressionConfig, build_codec
from tests.processes import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(40)]

KEY, PREFIX = "the-run-key", "keyed_state_avg"
STATE = {"params": torch.arange(64, dtype=torch.float32), "round": 3}


def _averager(dht):
    from diloco.comm.hivemind.averager import ExactAverager

    return ExactAverager(
        [torch.zeros(64)],
        dht,
        codec=build_codec(CompressionConfig()),
        run_key=KEY,
        start=True,
        prefix=PREFIX,
        target_group_size=2,
        min_group_size=2,
        request_timeout=2.0,
        shutdown_timeout=5,
    )


async def _strangers_asks(addresses: list[str], member) -> list[str]:
    """What a stranger (a peer of no DHT, holding no key) gets for each way of asking ``member``
    for its state: the messages it received, or the error it got."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.p2p import P2P
    from hivemind.proto import averaging_pb2
    from hivemind.utils.serializer import MSGPackSerializer

    from diloco.comm.hivemind.averager import ExactAverager

    p2p = await P2P.create(initial_peers=addresses)
    ours = ExactAverager.get_stub(p2p, member, namespace=PREFIX)
    forged = StateAccess("another-key").request({"manifest": True}, requester=p2p.peer_id.to_bytes(),
                                                server=member.to_bytes())  # fmt: skip
    parts = {"digest": manifest_of(STATE).digest(), "first": 0, "stop": 1}

    def request(asked: dict) -> averaging_pb2.DownloadData:
        return averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(asked))

    # hivemind's own download request (an empty DownloadRequest), to the handler our averager's class names
    stock = type("ExactAverager", (DecentralizedAverager,), {}).get_stub(p2p, member, namespace=PREFIX)
    asks = [
        lambda: stock.rpc_download_state(averaging_pb2.DownloadRequest()),
        lambda: ours.rpc_download_state(averaging_pb2.DownloadData()),
        lambda: ours.rpc_download_state_part(request({"manifest": True})),
        lambda: ours.rpc_download_state_part(request(forged)),
        lambda: ours.rpc_download_state_part(request(parts)),
    ]
    got = []
    try:
        for ask in asks:
            try:
                got.append(f"{len([m async for m in await ask()])} messages")
            except Exception as error:
                got.append(str(error))
    finally:
        await p2p.shutdown()
    return got


def test_a_stranger_with_a_members_address_gets_none_of_its_state_and_a_key_holder_downloads_it(tmp_path):
    served_log = tmp_path / "member.log"
    handler = logging.FileHandler(served_log)  # the member's averager process (forked) writes here too
    logging.getLogger("diloco.comm.hivemind.state_access").addHandler(handler)
    hm = HivemindConfig(host="127.0.0.1", startup_timeout_s=30.0)
    dhts, averagers = [start_dht(hm, run_key=KEY, client_mode=False)], []
    try:
        dhts.append(start_dht(hm, run_key=KEY, initial_peers=visible_addresses(dhts[0]), client_mode=False))
        member, holder = averagers = [_averager(dht) for dht in dhts]
        member.share_state({"round": 3}, lambda use: use(STATE), priority=1.0)

        got = asyncio.run(_strangers_asks(visible_addresses(dhts[0]), member.peer_id))
        assert len(got) == 5 and all(REFUSED in answer for answer in got), got
        assert any("not made with the run key" in answer for answer in got), got
        wait_for(lambda: "refused to serve our state to peer" in served_log.read_text(), 10, "the member's line")
        assert served_log.read_text().count("refused to serve our state to peer") == 1, served_log.read_text()

        deadline, found = time.monotonic() + 20, None
        while found is None and time.monotonic() < deadline:  # until the member's offer reached the holder's DHT
            found = holder.load_state_from_peers(timeout=10)
        assert found is not None
        metadata, state = found
        assert metadata["round"] == 3 and torch.equal(state["params"], STATE["params"]), found

        blob = serialize_state(STATE).getvalue()  # as a helper offers a relayed state: whole, no manifest
        member.share_state({"round": 4}, lambda _serialize: io.BytesIO(blob), priority=2.0)
        metadata, tensors = holder.load_state_from_peers(timeout=10)
        assert metadata["round"] == 4 and tensors[0].numpy().tobytes() == blob
    finally:
        logging.getLogger("diloco.comm.hivemind.state_access").removeHandler(handler)
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
