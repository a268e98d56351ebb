"""``diloco bench faults``: the faults of a volunteer run, each met by real workers.

Four workers (real ``diloco train`` processes and their hivemind peers) train the same run once
without faults and once per scenario; in the network testbed when run as root (each worker in
its namespace, links shaped to ``--rate``), on loopback otherwise:

    crash      kill -9 one worker mid-round, restart it ``--outage`` seconds later (same command)
    cut        cut one worker's link for ``--outage`` seconds (testbed; on loopback its processes
               are stopped with SIGSTOP instead, which its peers see the same way)
    split      cut the network between the first half of the workers (with the bootstrap peer)
               and the rest for ``--outage`` seconds (testbed only)
    slow       one worker's link at 1/10 of the others' rate, each worker declaring its rate (testbed only)
    join       a fifth worker joins at round ``--join-round`` with ``diloco join --peers ADDR``
               and no config file (the run's config from a live peer)
    bad        one worker sends NaN, another 100 x scaled pseudo-gradients
    wrong_key  a worker with a wrong run key runs beside the run from its start, and peers with other
               wrong keys try ``diloco join`` three times (counted only while the run is live: a run
               that is over refuses a join with the same one line)

The split, join and wrong_key runs are paced (``faults.step_delay_s``), so that they outlive their
fault on a fast machine too, until the fault is over (the run one model again, the newcomer
averaging, the attempts made): then they finish at this machine's pace
(``faults.step_delay_until``).

Per scenario: rounds the healthy workers completed, the longest time a round spent syncing
(comm_s, against ``comm.deadline_s``) for the healthy and for the faulty workers (a crashed,
cut-off or slow worker, a bad sender), whether the workers alive at the end hold identical
params, and the final val loss over the fault-free run's. Writes ``results.json`` under ``--out``.

    diloco bench faults                              # every scenario (~25 min on 2 cores)
    diloco bench faults --scenarios crash,join       # some
"""

from __future__ import annotations

import functools
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.lifetime import signal_tree, stop_all

if TYPE_CHECKING:
    from diloco.tools.launcher import Child

RUN_KEY = "bench-faults-key"
# the least a paced run lasts, however fast this machine trains, unless its fault is over sooner:
KEY_ATTEMPT_S = 30.0  # wrong_key: one diloco join attempt (a process start, then a roster probe of 10 s)
# join: a newcomer's way in (a process start, the roster probe, the run's config, its model and peer):
# about 17 s on 2 idle cores, more on busy ones, then its first round
JOIN_START_S = 60.0
# split: the cut seen (a round's deadline, the records' TTL), the heal found (a redial, a round or
# two) and the run one model again (the default of ``FaultRun.split_run_s``; on 2 cores it was one
# model again about 60 s in)
SPLIT_RUN_S = 150.0


@dataclass
class FaultRun:
    """What the scenarios need to know about a workload."""

    overrides: list[str]  # the run's config, as KEY=VALUE words
    workers: int = 4
    sync_every: int = 20
    steps: int = 200
    outage_s: float = 20.0
    join_round: int = 5
    key_attempts: int = 3  # wrong_key: how many times the intruder tries diloco join
    # split: the cuts, one after another, each given as the workers on each side of it (default: one
    # cut into two halves); the next cut comes once the run is one model again
    cuts: tuple[tuple[tuple[int, ...], ...], ...] = ()
    first_cut_round: int = 3  # split: the round in the middle of which the first cut comes (2 at the earliest:
    # every worker must have seen every other's roster record, which round 1 makes sure of)
    rate_mbit: float = 0.0  # testbed link rate; 0 = loopback (no testbed)
    split_run_s: float = SPLIT_RUN_S  # split: the least the run lasts, its steps paced to it
    timeout_s: float = 900.0


@dataclass
class ScenarioResult:
    scenario: str
    rounds_completed: int  # fewest rounds among the workers that were never faulty
    longest_sync_s: float  # the longest time a round of those workers spent in its sync
    longest_sync_faulty_s: float  # the same for the faulty workers (0 when none)
    deadline_s: float
    params_agree: bool  # the workers alive at the end hold identical params
    final_loss: float  # mean of those workers' final val loss
    loss_ratio: float | None = None  # final_loss / the fault-free run's
    exit_codes: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Cluster:
    """A bootstrap peer and workers as processes of this machine (each in its testbed namespace
    when a testbed is given). ``close()`` stops them all; use it as a context manager."""

    def __init__(self, overrides: Sequence[str], run_dir: Path, *, slots: int, testbed=None, run_key: str = ""):
        from diloco.tools import warm_start
        from diloco.tools.launcher import start_bootstrap

        self.overrides, self.run_dir, self.slots, self.testbed = list(overrides), run_dir, slots, testbed
        self.run_dir.mkdir(parents=True, exist_ok=True)
        warm_start.prepare()  # the imports of the bootstrap peer and the workers, started now
        host = testbed.host if testbed else "127.0.0.1"
        self.bootstrap, self.peers = start_bootstrap(
            host=host, timeout_s=120, log=self.run_dir / "bootstrap.log", run_key=run_key
        )
        self.processes: dict[int, Child] = {}
        self.others: list[Child] = []
        self._logs = []

    def _spawn(self, slot: int, argv: list[str], *, log_name: str) -> Child:
        from diloco.tools.launcher import start_child

        log = (self.run_dir / log_name).open("ab")
        self._logs.append(log)
        return start_child(argv, log, testbed=self.testbed, slot=slot)

    def _common(self, threads: int) -> list[str]:
        peers = "[" + ",".join(f"'{p}'" for p in self.peers) + "]"
        return [
            *self.overrides,
            f"run.dir={self.run_dir}",
            f"worker.threads={threads}",
            f"comm.hivemind.initial_peers={peers}",
        ]

    def start(self, index: int, extra: Sequence[str] = (), *, threads: int = 1) -> Child:
        argv = [sys.executable, "-m", "diloco.cli", "train", *self._common(threads), f"worker.index={index}", *extra]
        self.processes[index] = self._spawn(index, argv, log_name=f"worker-{index}.log")
        return self.processes[index]

    def join(
        self, extra: Sequence[str] = (), *, slot: int, threads: int = 1, log_name: str = "", only_address: bool = False
    ) -> Child:
        """``diloco join`` through the bootstrap peer (``slot`` only picks the testbed namespace).
        With ``only_address`` the joiner passes none of the run's settings, only its own machine's
        and the run's id: the run's config comes from a live peer."""
        if only_address:
            run_id = [o for o in self.overrides if o.startswith("comm.run_id=")][-1:]
            own = [f"run.dir={self.run_dir}", f"worker.threads={threads}", *run_id]
        else:
            own = self._common(threads)
        argv = [sys.executable, "-m", "diloco.cli", "join", "--peers", self.peers[0], *own, *extra]
        process = self._spawn(slot, argv, log_name=log_name or f"join-{slot}.log")
        self.others.append(process)
        return process

    def helper(self, slot: int, *, log_name: str = "") -> Child:
        """``diloco helper`` through the bootstrap peer, in the testbed namespace ``slot``."""
        argv = [sys.executable, "-m", "diloco.cli", "helper", "--peers", self.peers[0], *self._common(1)]
        process = self._spawn(slot, argv, log_name=log_name or f"helper-{slot}.log")
        self.others.append(process)
        return process

    def signal(self, index: int, signum: int) -> None:
        signal_tree(self.processes[index].pid, signum)

    def wait_for_step(self, index: int, step: int, timeout_s: float) -> None:
        """Until worker ``index`` has logged inner step ``step`` (its JSONL step records)."""
        self.wait_for(index, lambda: latest_step(self.run_dir, index) >= step, timeout_s, f"reach step {step}")

    def wait_for_record(self, index: int, holds: Callable[[dict], bool], timeout_s: float) -> None:
        """Until worker ``index`` has written a round record for which ``holds`` is true."""

        def written() -> bool:
            return any(r.get("event") == "round" and holds(r) for r in written_records(self.run_dir, index))

        self.wait_for(index, written, timeout_s, "write such a round record")

    def wait_for(self, index: int, done: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Until ``done()``, polling the records worker ``index`` writes; ``TimeoutError`` past
        ``timeout_s`` or once the worker has exited."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline or self.processes[index].poll() is not None:
                raise TimeoutError(f"worker {index} did not {what} within {timeout_s:.0f} s")
            time.sleep(0.5)  # polling a file another process writes

    def wait_all(self, timeout_s: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout_s
        codes = {}
        for index, process in self.processes.items():
            try:
                codes[index] = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[index] = -1
        return codes

    def close(self) -> None:
        stop_all([*self.processes.values(), *self.others, self.bootstrap])
        for log in self._logs:
            log.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def written_records(run_dir: Path, index: int) -> list[dict]:
    """Worker ``index``'s records so far, whole lines only: it may be writing the last one."""
    path = run_dir / f"worker-{index}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def latest_step(run_dir: Path, index: int) -> int:
    steps = [record.get("step", -1) for record in written_records(run_dir, index)]
    return max(steps, default=-1)


@dataclass
class Injection:
    """What a scenario's fault acts on, once the run's workers are started; the scenario adds
    to ``notes`` what the table should say."""

    cluster: Cluster
    testbed: object  # diloco.tools.testbed.Testbed, or None on loopback
    plan: FaultRun
    run_dir: Path
    keyed: list[str]  # the run key's override for a worker it starts, or nothing
    notes: list[str]

    @property
    def victim(self) -> int:
        return self.plan.workers - 1

    @property
    def mid_round(self) -> int:
        """An inner step in the middle of the third round."""
        return 2 * self.plan.sync_every + self.plan.sync_every // 2


def _slow_rate(plan: FaultRun) -> float:
    return (plan.rate_mbit or 20.0) / 10


def _crash(run: Injection) -> None:
    run.cluster.wait_for_step(run.victim, run.mid_round, run.plan.timeout_s)
    run.cluster.signal(run.victim, signal.SIGKILL)
    run.cluster.processes[run.victim].wait()
    time.sleep(run.plan.outage_s)  # the outage itself, not synchronisation
    run.cluster.start(run.victim, run.keyed)


def _cut_off(run: Injection) -> None:
    run.cluster.wait_for_step(run.victim, run.mid_round, run.plan.timeout_s)
    _cut(run.cluster, run.testbed, run.victim, down=True)
    time.sleep(run.plan.outage_s)  # the outage itself
    _cut(run.cluster, run.testbed, run.victim, down=False)


def split_cuts(plan: FaultRun) -> list[list[list[int]]]:
    """split: each cut's sides, the workers on each; the first side keeps the bootstrap peer. By
    default one cut: the first half of the workers and the rest."""
    if plan.cuts:
        return [[list(side) for side in sides] for sides in plan.cuts]
    half = plan.workers // 2
    return [[list(range(half)), list(range(half, plan.workers))]]


def _split(run: Injection) -> None:
    """Each cut in turn: cut the network between its sides in the middle of a round (round
    ``first_cut_round`` for the first); heal it ``outage_s`` after every worker has recorded the
    workers of the other sides missing (the split seen); the next cut once the run is one model
    again, in the middle of the round in progress or the next. The fault is over once the run is
    one model after the last cut."""
    step = next_mid_round((run.plan.first_cut_round - 1) * run.plan.sync_every, run.plan.sync_every)
    for sides in split_cuts(run.plan):
        if step >= run.plan.steps:
            run.notes.append("no round left for the next cut")
            return
        run.cluster.wait_for_step(0, step, run.plan.timeout_s)
        cut_round = step // run.plan.sync_every + 1
        run.testbed.split(sides)
        try:
            for side in sides:
                others = set(range(run.plan.workers)) - set(side)
                for worker in side:
                    seen = functools.partial(_misses_since, cut_round, others)
                    run.cluster.wait_for_record(worker, seen, run.plan.timeout_s)
            time.sleep(run.plan.outage_s)  # the outage itself, not synchronisation
        finally:
            run.testbed.heal()
        run.notes.append(f"split {' / '.join(','.join(map(str, side)) for side in sides)} in round {cut_round}")
        try:
            run.cluster.wait_for(0, functools.partial(_one_model_again, run), run.plan.timeout_s, "see one model again")
        except TimeoutError:
            return  # the notes say "never one model again"
        step = next_mid_round(latest_step(run.run_dir, 0), run.plan.sync_every)


def next_mid_round(step: int, sync_every: int) -> int:
    """The first step past ``step`` in the middle of a round: of the round in progress, or of the next."""
    middle = step // sync_every * sync_every + sync_every // 2
    return middle if middle > step else middle + sync_every


def _missed_and_merged(run: Injection) -> tuple[list[int], int | None]:
    """split: the rounds whose records missed a side, and the first round after them that every
    worker ended on the same params (one model again; None while there is none)."""
    hashes: dict[int, dict[int, str]] = {}  # round -> worker -> params digest
    missed = []
    for index in range(run.plan.workers):
        for record in written_records(run.run_dir, index):
            if record.get("event") == "round":
                hashes.setdefault(record["round"], {})[index] = record.get("param_sha256")
                if record.get("missing"):
                    missed.append(record["round"])
    merged = next(
        (
            r
            for r in sorted(hashes)
            if r > max(missed, default=0) and len(hashes[r]) == run.plan.workers and len(set(hashes[r].values())) == 1
        ),
        None,
    )
    return missed, merged


def _one_model_again(run: Injection) -> bool:
    return _missed_and_merged(run)[1] is not None


def _merge_notes(run: Injection) -> None:
    missed, merged = _missed_and_merged(run)
    if not missed:
        run.notes.append("no record missed a side")
        return
    seen = f"rounds {min(missed)}-{max(missed)} missed a side"
    run.notes.append(f"{seen}; one model again from round {merged}" if merged else f"{seen}; never one model again")


def _misses_since(first_round: int, workers: set[int], record: dict) -> bool:
    return record["round"] >= first_round and workers <= set(record.get("missing", ()))


def _slow_down(run: Injection) -> None:
    slow = _slow_rate(run.plan)
    run.testbed.set_rate(run.victim, up_mbit=slow, down_mbit=slow)
    run.notes.append(f"worker {run.victim} at {slow:g} Mbit/s")


def _join(run: Injection) -> None:
    plan = run.plan
    run.cluster.wait_for_step(0, plan.join_round * plan.sync_every, plan.timeout_s)
    joiner = run.cluster.join(slot=plan.workers, log_name=f"worker-{plan.workers}.log", only_address=True)
    run.cluster.processes[plan.workers] = joiner
    # the fault is over once the newcomer has averaged with others
    try:
        run.cluster.wait_for_record(plan.workers, lambda record: record.get("peers", 1) > 1, plan.timeout_s)
    except TimeoutError:
        run.notes.append("the newcomer never averaged with others")


def _intrude(run: Injection) -> None:
    plan, cluster = run.plan, run.cluster
    # a worker that skips diloco join's check runs beside the run, and tries to average with it
    intruder = cluster.start(plan.workers, ["comm.run_key=intruder"])
    del cluster.processes[plan.workers]
    cluster.others.append(intruder)
    # the run is up, with a roster to refuse them (step records come every logging.log_every steps)
    cluster.wait_for_step(0, 1, plan.timeout_s)
    live = _RunLiveness(run.run_dir, cluster.processes[0])
    refused = 0
    for attempt in range(plan.key_attempts):
        # a key of its own each time: two peers that share a wrong key form a run of their own
        attempt_process = cluster.join(
            [f"comm.run_key=guess-{attempt}"], slot=plan.workers, log_name=f"wrong-key-{attempt}.log"
        )
        # a run that is over refuses with the same line: only a refusal it outlived counts
        refused += attempt_process.wait(timeout=plan.timeout_s) == 2 and live.live()
    run.notes.append(
        f"diloco join with the wrong key refused {refused} of {plan.key_attempts} times while the run was live"
    )
    tried = _reached_step_while_live(run.run_dir, plan.workers, plan.sync_every, live, plan.timeout_s)
    run.notes.append(f"wrong-key worker tried to average while the run was live: {'yes' if tried else 'no'}")


def _intruder_rounds(run: Injection) -> None:
    rounds = [r for r in written_records(run.run_dir, run.plan.workers) if r.get("event") == "round"]
    grouped = [r for r in rounds if r.get("peers", 1) > 1]
    run.notes.append(f"wrong-key worker: {len(rounds)} rounds, {len(grouped)} of them in a group")


def _nothing(run: Injection) -> None:
    pass


def _no_overrides(plan: FaultRun, index: int) -> list[str]:
    return []


@dataclass(frozen=True)
class Scenario:
    """One fault of a volunteer run: what it injects, into which workers, and what it needs."""

    name: str
    inject: Callable[[Injection], None] = _nothing  # once every worker is started
    faulty: Callable[[FaultRun], set[int]] = lambda plan: set()  # workers counted apart from the healthy
    worker_overrides: Callable[[FaultRun, int], list[str]] = _no_overrides  # a worker's own settings
    pacing: Callable[[FaultRun], float] = lambda plan: 0.0  # seconds the run is paced to last at least, until
    # its fault is over (``inject`` has returned); 0 = not paced
    after: Callable[[Injection], None] = _nothing  # once every worker has ended
    run_key: str = ""
    needs_testbed: bool = False


def _last(plan: FaultRun) -> set[int]:
    return {plan.workers - 1}


def _declared_rates(plan: FaultRun, index: int) -> list[str]:
    # each worker declares its link rate, as a volunteer on a slow link would
    slow = _slow_rate(plan)
    return [f"comm.bandwidth_mbps={slow if index == plan.workers - 1 else slow * 10:g}"]


def _bad_payloads(plan: FaultRun, index: int) -> list[str]:
    return {1: ["faults.bad_payload=nan"], 2: ["faults.bad_payload=scaled"]}.get(index, [])


def _outlive_the_attempts(plan: FaultRun) -> float:
    # the run must outlive the intruder's attempts (on an idle machine a short run ended before the
    # first was refused)
    return plan.key_attempts * KEY_ATTEMPT_S


def _outlive_the_split(plan: FaultRun) -> float:
    return plan.split_run_s


def _outlive_the_joiners_start(plan: FaultRun) -> float:
    # the run must still be going when the newcomer is up (on an idle machine it ended a moment before)
    return JOIN_START_S


def _paced(seconds: float, plan: FaultRun, release: Path) -> list[str]:
    """A floor on the run's length, however fast this machine trains: a step delay spread over its
    steps, until the file ``release`` exists (the fault is over)."""
    return [f"faults.step_delay_s={seconds / plan.steps:.3f}", f"faults.step_delay_until={release}"]


NO_FAULT = Scenario("none")
TABLE = {
    scenario.name: scenario
    for scenario in (
        Scenario("crash", inject=_crash, faulty=_last),
        Scenario("cut", inject=_cut_off, faulty=_last),
        Scenario("split", inject=_split, pacing=_outlive_the_split, after=_merge_notes, needs_testbed=True),
        Scenario("slow", inject=_slow_down, faulty=_last, worker_overrides=_declared_rates, needs_testbed=True),
        # the joiner's first round may wait for it: counted apart
        Scenario("join", inject=_join, faulty=lambda plan: {plan.workers}, pacing=_outlive_the_joiners_start),
        Scenario("bad", faulty=lambda plan: {1, 2}, worker_overrides=_bad_payloads),
        Scenario("wrong_key", inject=_intrude, pacing=_outlive_the_attempts, after=_intruder_rounds, run_key=RUN_KEY),
    )
}
SCENARIOS = tuple(TABLE)


def run_scenario(name: str, plan: FaultRun, out: Path) -> ScenarioResult:
    """Run one scenario (or "none", the fault-free run) and measure it."""
    from diloco.tools.testbed import Testbed, testbed_unavailable

    scenario = TABLE.get(name, NO_FAULT)
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier run's records would end its pacing at once
    release = run_dir / "fault-over"  # the paced run's release (faults.step_delay_until)
    paced_s = scenario.pacing(plan)
    slots = plan.workers + 1  # room for a joiner, or a wrong-key peer
    overrides = [
        *plan.overrides,
        f"worker.count={plan.workers}",
        f"worker.slots={slots}",
        f"inner.steps={plan.steps}",
        f"outer.sync_every={plan.sync_every}",
        "checkpoint.every_rounds=1",
        f"comm.run_id=faults_{name}",
        *(_paced(paced_s, plan, release) if paced_s else []),
    ]
    use_testbed = plan.rate_mbit > 0 or scenario.needs_testbed
    if use_testbed and (reason := testbed_unavailable()) is not None:
        raise RuntimeError(f"scenario {name} needs the testbed: {reason}")
    testbed = Testbed(slots, up_mbit=plan.rate_mbit, down_mbit=plan.rate_mbit) if use_testbed else None
    notes: list[str] = []
    try:
        with Cluster(overrides, run_dir, slots=slots, testbed=testbed, run_key=scenario.run_key) as cluster:
            keyed = [f"comm.run_key={scenario.run_key}"] if scenario.run_key else []
            for i in range(plan.workers):
                cluster.start(i, scenario.worker_overrides(plan, i) + keyed)
            run = Injection(cluster, testbed, plan, run_dir, keyed, notes)
            try:
                scenario.inject(run)
            finally:
                release.touch()
            codes = cluster.wait_all(plan.timeout_s)
            scenario.after(run)
    finally:
        if testbed is not None:
            testbed.close()
    return _measure(name, run_dir, codes, scenario.faulty(plan), plan, overrides, notes)


class _RunLiveness:
    """Whether a run is still going, as a peer trying to reach it would see it: its worker has
    neither exited nor written its end record (after which it leaves the run)."""

    def __init__(self, run_dir: Path, worker: Child, index: int = 0):
        self.run_dir, self.worker, self.index = run_dir, worker, index

    def live(self) -> bool:
        if self.worker.poll() is not None:
            return False
        return not any(r.get("event") == "end" for r in written_records(self.run_dir, self.index))


def _reached_step_while_live(run_dir: Path, index: int, step: int, run: _RunLiveness, timeout_s: float) -> bool:
    """Whether worker ``index`` logged inner step ``step`` (its first sync: it then tries to average)
    while ``run`` was still going."""
    deadline = time.monotonic() + timeout_s
    while run.live() and time.monotonic() < deadline:
        if latest_step(run_dir, index) >= step:
            return run.live()
        time.sleep(0.5)  # polling a file another process writes
    return False


def _cut(cluster: Cluster, testbed, index: int, *, down: bool) -> None:
    if testbed is not None:
        testbed.set_link(index, up=not down)
    else:  # on loopback: a stopped process answers nobody, as a cut-off one does
        cluster.signal(index, signal.SIGSTOP if down else signal.SIGCONT)


def _deadline(overrides: Sequence[str]) -> float:
    values = [float(o.split("=", 1)[1]) for o in overrides if o.startswith("comm.deadline_s=")]
    return values[-1] if values else 60.0


def _measure(
    name: str, run_dir: Path, codes: dict[int, int], faulty: set[int], plan: FaultRun, overrides, notes
) -> ScenarioResult:
    ends, syncs, faulty_syncs, healthy_rounds = {}, [], [], []
    for index in codes:
        records = written_records(run_dir, index)
        times = [r.get("comm_s", 0.0) for r in records if r.get("event") == "round"]
        (faulty_syncs if index in faulty else syncs).extend(times)
        end = next((r for r in reversed(records) if r.get("event") == "end"), None)
        if end is not None:
            ends[index] = end
            if index not in faulty:
                healthy_rounds.append(end["rounds"])
    hashes = {end["param_sha256"] for end in ends.values()}
    losses = [end["val_loss"] for end in ends.values()]
    return ScenarioResult(
        scenario=name,
        rounds_completed=min(healthy_rounds, default=0),
        longest_sync_s=round(max(syncs, default=0.0), 2),
        longest_sync_faulty_s=round(max(faulty_syncs, default=0.0), 2),
        deadline_s=_deadline(overrides),
        params_agree=len(hashes) == 1 and len(ends) == len(codes),
        final_loss=round(sum(losses) / len(losses), 4) if losses else float("nan"),
        exit_codes=codes,
        notes=notes,
    )


def run_faults(plan: FaultRun, scenarios: Sequence[str], out: Path) -> list[ScenarioResult]:
    """The fault-free run, then each scenario; prints a table and writes ``results.json``."""
    out.mkdir(parents=True, exist_ok=True)
    baseline = run_scenario("none", plan, out)
    print(f"fault-free: {baseline.rounds_completed} rounds, final val loss {baseline.final_loss:.4f}", flush=True)
    results = [baseline]
    for name in scenarios:
        result = run_scenario(name, plan, out)
        result.loss_ratio = round(result.final_loss / baseline.final_loss, 4)
        results.append(result)
        print(format_row(result), flush=True)
        (out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    print(format_table(results))
    return results


def format_row(r: ScenarioResult) -> str:
    ratio = "-" if r.loss_ratio is None else f"{r.loss_ratio:.4f}"
    return (
        f"| {r.scenario} | {r.rounds_completed} | {r.longest_sync_s:.1f} s / {r.longest_sync_faulty_s:.1f} s "
        f"(deadline {r.deadline_s:g} s) | "
        f"{'yes' if r.params_agree else 'NO'} | {r.final_loss:.4f} | {ratio} | {'; '.join(r.notes)} |"
    )


def format_table(results: Sequence[ScenarioResult]) -> str:
    header = (
        "| scenario | rounds (healthy workers) | longest sync: healthy / faulty workers | params agree | "
        "final val loss | loss / fault-free | notes |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    return "\n".join([header, *(format_row(r) for r in results)])


def default_plan(data: str | None, overrides: Sequence[str], **settings) -> FaultRun:
    """The benchmark's workload: a small GPT on tinyshakespeare, so that seven 4-worker runs fit in
    about half an hour on 2 cores."""
    from diloco.bench.arms import default_data

    return FaultRun(
        overrides=[
            f"data.path={default_data(data)}",
            "model.n_layer=2",
            "model.n_embd=64",
            "inner.batch_size=12",
            "inner.warmup_steps=20",
            "logging.eval_batches=8",
            "logging.log_every=10",
            "comm.deadline_s=60",
            "comm.hivemind.matchmaking_s=15",
            *overrides,
        ],
        **settings,
    )


def run_faults_benchmark(*, scenarios: Sequence[str], out: Path, data: str | None, overrides, **settings) -> int:
    from diloco.tools.testbed import testbed_unavailable

    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        from diloco.errors import UsageError

        raise UsageError(f"--scenarios: {unknown[0]!r} is not one of {', '.join(SCENARIOS)}")
    if settings.get("rate_mbit") is None:
        settings["rate_mbit"] = 20.0 if testbed_unavailable() is None else 0.0
    if settings["rate_mbit"] == 0:  # loopback: the scenarios that need the testbed's links are left out
        for name in [s for s in scenarios if TABLE[s].needs_testbed]:
            print(f"scenario {name} needs the testbed (root): skipped", flush=True)
        scenarios = [s for s in scenarios if not TABLE[s].needs_testbed]
    plan = default_plan(data, overrides, **settings)
    where = f"testbed, links {plan.rate_mbit:g} Mbit/s" if plan.rate_mbit else "loopback"
    print(f"{plan.workers} workers, {plan.steps} steps, H={plan.sync_every}, {where}; out {out}", flush=True)
    run_faults(plan, scenarios, out)
    return 0


def add_arguments(parser) -> None:
    """``diloco bench faults``'s flags."""
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="applied to every run")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--data", help="text file (default data/tinyshakespeare.txt)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300, help="inner steps per worker")
    parser.add_argument("--sync-every", type=int, default=20, help="H")
    parser.add_argument("--outage", type=float, default=20.0, help="seconds a crashed worker or a cut link stays out")
    parser.add_argument("--join-round", type=int, default=5)
    parser.add_argument("--rate", type=float, help="testbed link rate, Mbit/s (default 20 as root, else loopback)")
    parser.add_argument("--out", default="runs/bench-faults", help="output folder")


def main(args) -> int:
    return run_faults_benchmark(
        scenarios=[s for s in args.scenarios.split(",") if s],
        out=Path(args.out),
        data=args.data,
        overrides=args.overrides,
        workers=args.workers,
        steps=args.steps,
        sync_every=args.sync_every,
        outage_s=args.outage,
        join_round=args.join_round,
        rate_mbit=args.rate,
    )
