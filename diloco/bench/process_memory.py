"""The memory of a process tree, read from /proc (Linux): a process and every process below it.

Each process's proportional set size (PSS, ``/proc/PID/smaps_rollup``) counts a page shared by n
processes as 1/n of it in each: summed over a tree, shared memory (a fork's copy-on-write pages,
hivemind's shared-memory buffers, the libraries every worker maps) counts once. Its resident set
size (RSS) counts every mapped page in full. ``PeakSampler`` samples a tree from a thread of its
own and keeps the largest sum of PSS it saw and the largest RSS of one process:

    with PeakSampler(os.getpid(), interval_s=0.25) as sampler:
        run_something_that_starts_processes()
    sampler.peak_pss_bytes, sampler.peak_rss_bytes

A peak shorter than the interval can fall between two samples.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from diloco.lifetime import descendants

KIB = 1024


@dataclass(frozen=True)
class ProcessMemory:
    """One process's memory at one moment, in bytes."""

    pid: int
    name: str  # /proc/PID/comm
    pss_bytes: int
    rss_bytes: int


def process_memory(pid: int) -> ProcessMemory | None:
    """``pid``'s PSS and RSS, or None when it is gone (or not ours to read)."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    fields = {}
    for line in rollup.splitlines()[1:]:
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[key] = int(value.split()[0]) * KIB
    if "Pss" not in fields:  # a zombie maps nothing
        return None
    return ProcessMemory(pid=pid, name=name, pss_bytes=fields["Pss"], rss_bytes=fields.get("Rss", 0))


def tree_memory(root: int) -> list[ProcessMemory]:
    """The memory of ``root`` and of every live process below it."""
    found = (process_memory(pid) for pid in sorted({root, *descendants(root)}))
    return [memory for memory in found if memory is not None]


@dataclass
class PeakSampler:
    """The largest summed PSS of ``root``'s tree and the largest RSS of one of its processes, sampled
    every ``interval_s`` by a thread between ``start()`` and ``stop()`` (or as a context manager)."""

    root: int
    interval_s: float = 0.25
    peak_pss_bytes: int = 0
    peak_rss_bytes: int = 0
    at_peak: list[ProcessMemory] = field(default_factory=list)  # the tree when its PSS peaked
    samples: int = 0
    pids_seen: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._sampled = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="bench-process-memory", daemon=True)

    def sample(self) -> None:
        """Read the tree once; keep what exceeds the peaks."""
        tree = tree_memory(self.root)
        total = sum(memory.pss_bytes for memory in tree)
        with self._sampled:
            if total > self.peak_pss_bytes:
                self.peak_pss_bytes, self.at_peak = total, tree
            self.peak_rss_bytes = max([self.peak_rss_bytes, *(memory.rss_bytes for memory in tree)])
            self.pids_seen.update(memory.pid for memory in tree)
            self.samples += 1
            self._sampled.notify_all()

    def wait_for_samples(self, count: int, timeout_s: float) -> bool:
        """Until ``count`` samples have been taken in all; False past ``timeout_s``."""
        with self._sampled:
            return self._sampled.wait_for(lambda: self.samples >= count, timeout=timeout_s)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> PeakSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling, after one last sample."""
        self._stop.set()
        self._thread.join()
        self.sample()

    def __enter__(self) -> PeakSampler:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def figures(self) -> dict:
        """What the sampler found, for a results file: the peaks and the tree at the PSS peak."""
        return {
            "peak_pss_bytes": self.peak_pss_bytes,
            "peak_process_rss_bytes": self.peak_rss_bytes,
            "samples": self.samples,
            "processes": len(self.pids_seen),
            "at_peak": sorted(
                ({"pid": m.pid, "name": m.name, "pss_bytes": m.pss_bytes} for m in self.at_peak),
                key=lambda process: -process["pss_bytes"],
            ),
        }
