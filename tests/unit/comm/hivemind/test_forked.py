"""A process forked from a worker gives back its copy-on-write share of the worker's tensors: once
the worker writes them (as every inner step does), the child does not keep the old pages."""

from __future__ import annotations

import os

import pytest
import torch

from diloco.bench.process_memory import process_memory
from diloco.comm.hivemind.forked import release_inherited_tensors

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="reads Linux's /proc"),
]

MB = 1024 * 1024


def _child_keeps_bytes(release: bool) -> tuple[int, float]:
    """(bytes released, the child's PSS once the parent rewrote 128 MB of tensors it forked with)."""
    params = torch.ones(32 * MB)  # 128 MB, as a model's params
    shared = torch.zeros(4 * MB).share_memory_()  # as the averager's buffer: kept
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: release (or not), say how much, wait for the parent's reading
        released = release_inherited_tensors() if release else 0
        shared.add_(1.0)  # the shared buffer still works
        os.write(ready_w, f"{released}\n".encode())
        os.read(done_r, 1)
        os._exit(0)
    try:
        released = int(os.read(ready_r, 64).decode())
        params.add_(1.0)  # the worker's next step writes every page: copied for the parent
        pss = process_memory(pid).pss_bytes
        assert float(shared[0]) == 1.0
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)
    return released, pss


def test_a_forked_child_that_releases_keeps_none_of_the_tensors_its_parent_rewrote():
    released, pss = _child_keeps_bytes(release=True)
    assert released >= 127 * MB  # whole pages inside it
    kept_without, pss_without = _child_keeps_bytes(release=False)
    assert kept_without == 0
    assert pss_without - pss >= 100 * MB  # the old pages stay with a child that does not release them
