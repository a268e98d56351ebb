"""A process forked from a worker gives back its copy-on-write share of the worker's tensors: once
the worker writes them (as every inner step does), the child does not keep the old pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="reads Linux's /proc"),
]

MB = 1024 * 1024


# in a fresh process (a test process's own history of forks and allocations would blur the figures):
# a parent with 128 MB of tensors forks a child, which releases them (or not); the parent then
# rewrites them, as a training step does, and prints what was released and the child's PSS
EXPERIMENT = """
import os, sys
import torch
from diloco.bench.process_memory import process_memory
from diloco.comm.hivemind.forked import release_inherited_tensors
params = torch.ones(32 * 1024 * 1024)
shared = torch.zeros(4 * 1024 * 1024).share_memory_()
ready_r, ready_w = os.pipe()
done_r, done_w = os.pipe()
pid = os.fork()
if pid == 0:
    released = release_inherited_tensors() if sys.argv[1] == "release" else 0
    shared.add_(1.0)
    os.write(ready_w, f"{released}\\n".encode())
    os.read(done_r, 1)
    os._exit(0)
released = int(os.read(ready_r, 64).decode())
params.add_(1.0)
pss = process_memory(pid).pss_bytes
assert float(shared[0]) == 1.0, "the child's shared buffer is not the parent's"
os.write(done_w, b"x")
os.waitpid(pid, 0)
print(released, pss)
"""


def _child_keeps_bytes(release: bool) -> tuple[int, int]:
    """(bytes released, the child's PSS once the parent rewrote the 128 MB of tensors it forked with)."""
    argv = [sys.executable, "-c", EXPERIMENT, "release" if release else "keep"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=50, check=True).stdout.split()
    return int(out[0]), int(out[1])


def test_a_forked_child_that_releases_keeps_none_of_the_tensors_its_parent_rewrote():
    released, pss = _child_keeps_bytes(release=True)
    assert released >= 127 * MB  # whole pages inside it
    kept_without, pss_without = _child_keeps_bytes(release=False)
    assert kept_without == 0
    assert pss_without - pss >= 100 * MB  # the old pages stay with a child that does not release them
