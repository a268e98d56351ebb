"""The memory of a process tree from /proc, on real processes: memory a grandchild allocates
raises the tree's sampled PSS peak by about that much, and pages a fork shares count once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from diloco.bench.process_memory import PeakSampler, process_memory, tree_memory
from diloco.lifetime import descendants

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="reads Linux's /proc"),
]

MB = 1024 * 1024
ALLOCATED = 128 * MB
# the allocating process: says it is ready, allocates (and touches) N bytes once told to, with
# "fork" forks a child that shares them, says so, and holds them until its input ends
ALLOCATE = """
import os, sys
print("ready", flush=True)
sys.stdin.readline()
block = b"\\x01" * int(sys.argv[1])
if sys.argv[2] == "fork" and os.fork() == 0:
    sys.stdin.read()
    os._exit(0)
print("allocated", flush=True)
sys.stdin.read()
"""
# its parent, so that the allocation happens a generation below the test's child
PARENT = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', *sys.argv[1:]]))"


@contextlib.contextmanager
def allocator(mode: str):
    """A child whose own child allocates ``ALLOCATED`` bytes when sent a line; killed at the end."""
    child = subprocess.Popen(
        [sys.executable, "-c", PARENT, ALLOCATE, str(ALLOCATED), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        yield child
    finally:
        below = descendants(child.pid)
        child.stdin.close()
        try:
            child.wait(timeout=10)
        finally:
            for pid in [child.pid, *below]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _allocate(child: subprocess.Popen) -> None:
    child.stdin.write("go\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "allocated"


def _peak_after_two_more_samples(sampler: PeakSampler) -> int:
    assert sampler.wait_for_samples(sampler.samples + 2, timeout_s=20)
    return sampler.peak_pss_bytes


def test_a_grandchilds_allocation_raises_the_sampled_peak_of_the_tree_by_about_that_much():
    with allocator("alone") as child, PeakSampler(os.getpid(), interval_s=0.05) as sampler:
        before = _peak_after_two_more_samples(sampler)
        _allocate(child)
        after = _peak_after_two_more_samples(sampler)
        assert len(sampler.pids_seen) >= 3  # this process, the child and the grandchild
    assert 0.9 * ALLOCATED < after - before < 1.2 * ALLOCATED, (before / MB, after / MB)
    assert sampler.peak_rss_bytes > ALLOCATED  # the grandchild's own
    figures = sampler.figures()
    assert figures["peak_pss_bytes"] == sum(process["pss_bytes"] for process in figures["at_peak"]) >= after
    assert any(p["pid"] != os.getpid() and p["pss_bytes"] > ALLOCATED for p in figures["at_peak"]), figures


def test_pages_a_fork_shares_count_once_in_the_trees_pss_and_twice_in_rss():
    with allocator("fork") as child:
        before = tree_memory(child.pid)
        _allocate(child)
        after = tree_memory(child.pid)
    pss = sum(m.pss_bytes for m in after) - sum(m.pss_bytes for m in before)
    rss = sum(m.rss_bytes for m in after) - sum(m.rss_bytes for m in before)
    assert len(after) == 3  # the child, the allocating grandchild and its fork
    assert 0.9 * ALLOCATED < pss < 1.2 * ALLOCATED, pss / MB
    assert rss > 1.9 * ALLOCATED, rss / MB


def test_a_process_that_is_gone_has_no_memory():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    assert process_memory(process.pid) is None
    assert process_memory(os.getpid()).pss_bytes > 0
