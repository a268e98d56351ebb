"""``diloco local``: a bootstrap peer and M workers on this machine, watched until they finish.

``diloco testbed`` runs the same, each worker in its own network namespace on a shaped link
(``diloco/tools/testbed.py``). With ``comm.backend=simulator`` the M workers are threads of this
process instead, taking turns (see ``diloco/comm/simulator.py``); the run directory they write is
the same.

Each worker is a real ``diloco train`` process in its own session (so a terminal's Ctrl-C
reaches only this launcher, which stops the workers in order; forked from a warm process,
``warm_start.py``, which saves each seconds of imports) with ``cores / M`` torch threads
(several workers on one machine slow each other far more than the sum of their work
otherwise). Worker output goes to ``RUN_DIR/worker-<i>.log``; progress is read from the
workers' JSONL records, each opened by a ``start`` record the launcher writes (the files are
appended to by every rerun: this launch is what follows it). At the end the launcher writes
``summary.json`` and prints it, with each failed worker's error (``outcome.py``, which also
gives the exit code).

``diloco launch`` (``launch.py``) runs the same way, each worker the user's own script instead
of ``diloco train`` (``worker_process``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

import torch

from diloco.comm.base import CommError
from diloco.comm.run_key_env import RUN_KEY_ENV
from diloco.config import Config, load_config
from diloco.config.launch_env import Launch
from diloco.errors import UsageError
from diloco.lifetime import stop_all, terminate_with_parent
from diloco.tools import warm_start
from diloco.tools.outcome import Failure, failure_of_exception, failure_of_process, report
from diloco.tools.testbed import Testbed
from diloco.worker.metrics import format_duration, mark_start, write_summary

logger = logging.getLogger(__name__)
Child = subprocess.Popen | warm_start.WarmChild  # a worker or helper this launcher started (start_child)

REFRESH_S = 2.0  # progress refresh period
HELPER_WAIT_S = 120.0  # how long a helper waits for the workers it starts beside to publish their roster


def worker_overrides(
    overrides: list[str], index: int, count: int, run_dir: Path, peers: list[str], threads: int
) -> list[str]:
    """Worker ``index``'s overrides: the launch's ``overrides``, then its own place in the run."""
    peer_list = "[" + ",".join(f"'{peer}'" for peer in peers) + "]"
    return [
        *overrides,
        f"worker.index={index}",
        f"worker.count={count}",
        f"run.dir={run_dir}",
        f"comm.hivemind.initial_peers={peer_list}",
        f"worker.threads={threads}",
    ]


def worker_process(
    config_path: str | None, overrides: list[str], script: list[str] | None = None, *, join: bool = False
) -> tuple[list[str], dict[str, str] | None]:
    """A worker's command and what it adds to the environment: ``diloco train`` with the config
    file and ``overrides``; or the user's ``script`` (``diloco launch``), run as given, told them
    through ``DILOCO_LAUNCH`` (``config/launch_env.py``), with ``join``: a live run required."""
    if script is not None:
        return list(script), Launch(config_path, tuple(overrides), join=join).to_environment()
    config_args = [config_path] if config_path else []
    verbose = ["--verbose"] if logger.isEnabledFor(logging.DEBUG) else []
    return [sys.executable, "-m", "diloco.cli", *verbose, "train", *config_args, *overrides], None


def _helper_command(config_path: str | None, overrides: list[str], peers: list[str]) -> list[str]:
    """``diloco helper`` for the run the workers start: it waits for their roster (``HELPER_WAIT_S``)."""
    verbose = ["--verbose"] if logger.isEnabledFor(logging.DEBUG) else []
    config_args = [config_path] if config_path else []
    return [
        sys.executable, "-m", "diloco.cli", *verbose, "helper", *config_args, *overrides,
        "--peers", ",".join(peers), "--wait", f"{HELPER_WAIT_S:g}",
    ]  # fmt: skip


def launch_config(
    config_path: str | None, overrides: list[str], *, workers: int, run_dir: str | None
) -> tuple[Config, list[str]]:
    """The config of a launch of ``workers`` workers on this machine, ``run_dir`` (``--run-dir``) as
    its ``run.dir``, checked before anything starts: (cfg, the overrides every worker gets)."""
    if workers < 1:
        raise UsageError(f"--workers={workers} must be at least 1")
    if run_dir:
        overrides = [*overrides, f"run.dir={run_dir}"]
    return load_config(config_path, [*overrides, f"worker.count={workers}"]), overrides


def threads_per_worker(workers: int) -> int:
    """Torch threads for each of ``workers`` processes sharing this machine's cores."""
    return max(1, (os.cpu_count() or 1) // workers)


def _gpu_share(cfg: Config, workers: int) -> list[str]:
    """Workers sharing this machine's GPU each take 1/M of its memory, unless the config says otherwise:
    one worker's burst then fails that worker alone, with the one-line out-of-memory error."""
    on_gpu = cfg.worker.device != "cpu" and torch.cuda.is_available()
    if not on_gpu or workers < 2 or cfg.worker.gpu_memory_fraction:
        return []
    return [gpu_share_override(workers)]


def gpu_share_override(workers: int) -> str:
    """The setting that gives each of ``workers`` sharing one GPU its share of its memory."""
    return f"worker.gpu_memory_fraction={1 / workers:.6f}"


class _Progress:
    """Follows each worker's JSONL file: its latest step and round records, and the bytes it sent."""

    def __init__(self, run_dir: Path, count: int):
        self.paths = [run_dir / f"worker-{i}.jsonl" for i in range(count)]
        self.offsets = [path.stat().st_size if path.exists() else 0 for path in self.paths]
        self.latest: list[dict] = [{} for _ in range(count)]
        self.sent = [0] * count
        self.started = time.monotonic()

    def poll(self) -> None:
        for i, path in enumerate(self.paths):
            if not path.exists():
                continue
            with path.open("rb") as file:
                file.seek(self.offsets[i])
                chunk = file.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written is read next time
            self.offsets[i] += len(complete)
            for line in complete.splitlines():
                record = json.loads(line)
                self.latest[i].update({f"{record['event']}.{k}": v for k, v in record.items()})
                if record["event"] == "round":
                    self.sent[i] += record.get("bytes_sent", 0)

    def lines(self, total_steps: int, states: list[str]) -> list[str]:
        """A header (progress of the slowest worker, elapsed time, ETA), then one line per worker. A
        worker's own records tell its run's length (a script may set its own ``inner.steps``)."""
        steps = [latest.get("step.step", 0) for latest in self.latest]
        totals = [latest.get("start.total_steps", total_steps) for latest in self.latest]
        done = min(step / total if total else 1.0 for step, total in zip(steps, totals, strict=True))
        elapsed = time.monotonic() - self.started
        eta = format_duration(elapsed * (1 - done) / done) if done > 0 else "-"
        out = [f"{100 * done:.0f}% done  {format_duration(elapsed)} elapsed  ETA {eta}"]
        for i, latest in enumerate(self.latest):
            loss = latest.get("round.val_loss", latest.get("step.loss"))
            out.append(
                f"  worker {i}: step {steps[i]:>5}/{totals[i]}"
                f"  round {latest.get('round.round', 0):>3}"
                f"  loss {loss if loss is None else f'{loss:.4f}'}"
                f"  {latest.get('step.tokens_per_s', 0):>8.0f} tok/s"
                f"  peers {latest.get('round.peers', '-')}"
                f"  sent {self.sent[i] / 1e6:.1f} MB  {states[i]}"
            )
        return out


def run_local(
    cfg: Config,
    config_path: str | None,
    overrides: list[str],
    *,
    workers: int,
    helpers: int = 0,
    helper_overrides: tuple[str, ...] = (),
    testbed: Testbed | None = None,
    script: list[str] | None = None,
) -> int:
    """Run ``workers`` workers to the end, on loopback or each in its namespace of ``testbed``,
    with ``helpers`` helpers beside them (``diloco helper``, with ``helper_overrides`` on top; in
    ``testbed``'s namespaces after the workers'), stopped once the workers are done; each worker
    ``diloco train``, or the user's ``script`` (``worker_process``). Returns the exit code: 0 when
    every worker finished."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    threads = threads_per_worker(workers)
    overrides = [*overrides, *_gpu_share(cfg, workers)]
    children: list[Child] = []
    helper_children: list[Child] = []
    helper_codes: list[int | None] = []
    logs = []
    host = testbed.host if testbed else "127.0.0.1"
    warm_start.prepare()  # the imports of the bootstrap peer and the workers, started now
    bootstrap, peers = start_bootstrap(
        host=host,
        timeout_s=cfg.comm.hivemind.startup_timeout_s,
        log=run_dir / "bootstrap.log",
        run_key=cfg.comm.run_key,
    )
    try:
        print(f"bootstrap peer: {peers[0]}")
        where = f"each in its network namespace, links {testbed.describe()}" if testbed else "on loopback"
        print(f"run directory:  {run_dir}   ({workers} workers {where}, {threads} threads each)")
        log_paths, log_offsets = _launch_marked(run_dir, workers)
        progress = _Progress(run_dir, workers)
        for i in range(workers):
            log = log_paths[i].open("ab")
            logs.append(log)
            place = worker_overrides(overrides, i, workers, run_dir, peers, threads)
            command, env = worker_process(config_path, place, script)
            children.append(start_child(command, log, testbed=testbed, slot=i, env=env))
        command = _helper_command(config_path, [*overrides, *helper_overrides], peers)
        _start_helpers(command, run_dir, range(workers, workers + helpers), testbed, logs=logs, into=helper_children)
        _watch(progress, cfg.inner.steps, lambda: [_state(child) for child in children])
        helper_codes = [helper.poll() for helper in helper_children]  # None: still serving, as it should
    except KeyboardInterrupt:
        print("\ninterrupted: stopping workers ...", flush=True)
        stop_all(children)
        return 130
    finally:
        stop_all(children)
        stop_all(helper_children)
        for log in logs:
            log.close()
        stop_all([bootstrap])
    return _ended(cfg, children, helper_codes, log_paths, log_offsets)


def _launch_marked(run_dir: Path, workers: int) -> tuple[list[Path], list[int]]:
    """Each worker's log, and where this launch's lines start in it (earlier runs' come before);
    each worker's records marked where this launch's follow (a worker that writes none failed)."""
    log_paths = [run_dir / f"worker-{i}.log" for i in range(workers)]
    log_offsets = [path.stat().st_size if path.exists() else 0 for path in log_paths]  # earlier runs'
    for i in range(workers):
        mark_start(run_dir, i)  # this launch's records follow; a worker that writes none failed
    return log_paths, log_offsets


def _start_helpers(
    command: list[str], run_dir: Path, slots: range, testbed: Testbed | None, *, logs: list, into: list[Child]
) -> None:
    """A helper started with ``command`` in each of ``slots`` (after the workers'), each logging to
    its own file; its log goes into ``logs`` and it into ``into`` as it starts, for the caller to close."""
    for i in slots:
        log = (run_dir / f"helper-{i - slots.start}.log").open("ab")
        logs.append(log)
        into.append(start_child(command, log, testbed=testbed, slot=i))


def _ended(
    cfg: Config, children: list[Child], helper_codes: list[int | None], log_paths: list[Path], log_offsets: list[int]
) -> int:
    """The launch's exit code once its children stopped: each failed worker's failure read from
    its log since ``log_offsets``, each failed helper said on stderr."""
    failures = {
        i: failure_of_process(i, child.returncode, log_paths[i], log_offsets[i])
        for i, child in enumerate(children)
        if child.returncode != 0
    }
    for i, code in enumerate(helper_codes):
        if code not in (None, 0):
            print(f"helper {i} failed (exit code {code}); see {cfg.run_dir / f'helper-{i}.log'}", file=sys.stderr)
    return _report(cfg, failures, exited={i for i, child in enumerate(children) if child.returncode == 0})


def _report(cfg: Config, failures: dict[int, Failure], exited: set[int] | frozenset[int] = frozenset()) -> int:
    """Write ``summary.json`` of the run that just ended (the workers whose process ``exited`` 0
    finished, whatever records they kept), print it and its failures; the exit code."""
    summary = write_summary(cfg.run_dir, ended=True, errors=_errors(failures), exited=exited)
    return report(summary, failures, params_may_differ=cfg.outer.eager)  # eager: they differ by design


def start_child(
    command: list[str], log, *, testbed: Testbed | None = None, slot: int = 0, env: dict[str, str] | None = None
) -> Child:
    """A worker or helper child writing to ``log``, in its own session (a terminal's Ctrl-C reaches
    the launcher only, which stops them in order), dying with the launcher; in ``testbed``'s
    namespace ``slot``, listening at its address, when given; with ``env`` added to this process's
    environment. A ``diloco`` command on this machine is forked from a warm process
    (``warm_start.py``), which saves it seconds of imports."""
    if testbed is not None:
        command = [*command, f"comm.hivemind.host={testbed.address(slot)}"]
    if warm_start.starts_warm(command):
        return warm_start.start(command, Path(log.name), netns=testbed.namespace(slot) if testbed else None, env=env)
    if testbed is not None:
        command = testbed.command(slot, command)
    return start_fresh(command, log, env=env)


def start_fresh(command: list[str], log, *, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``command`` as a fresh process in its own session, dying with the launcher, writing to ``log``
    (None: to this process's output)."""
    return subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env} if env else None,
        start_new_session=True,
        preexec_fn=terminate_with_parent if sys.platform == "linux" else None,
    )


def _watch(progress: _Progress, total_steps: int, states, out: TextIO = sys.stdout) -> None:
    """Show the workers' progress until no worker is running: redrawn in place on a terminal;
    piped to a file, printed again only when it changed (and with no control codes)."""
    last_poll, shown = 0.0, []
    terminal = out.isatty()
    while True:
        current = states()
        if time.monotonic() - last_poll >= REFRESH_S or "running" not in current:
            progress.poll()
            lines = progress.lines(total_steps, current)
            if terminal:
                # back to the first line of the last view, clear to the end of the screen, redraw
                out.write((f"\x1b[{len(shown)}F\x1b[J" if shown else "") + "\n".join(lines) + "\n")
                shown = lines
            elif lines[1:] != shown[1:]:  # the header's clock alone is no news in a log file
                out.write("\n".join(lines) + "\n")
                shown = lines
            out.flush()
            last_poll = time.monotonic()
        if "running" not in current:
            return
        time.sleep(0.2)  # a UI refresh, not synchronisation: the loop ends when the workers do


def simulate(cfg: Config, *, workers: int, show_progress: bool = False) -> dict:
    """Run M simulated workers as threads of this process (``comm.backend=simulator``), each the real
    ``train()`` loop; return the run's summary (also written to ``summary.json``)."""
    return write_summary(cfg.run_dir, ended=True, errors=_errors(_simulate(cfg, workers, show_progress)))


def _errors(failures: dict[int, Failure]) -> dict[int, str]:
    return {i: failure.describe() for i, failure in failures.items()}


def _simulate(cfg: Config, workers: int, show_progress: bool) -> dict[int, Failure]:
    """``simulate``'s run: the workers that failed, each with its error."""
    from diloco.comm.simulator import forget_group, group_for
    from diloco.errors import UserError
    from diloco.worker.faults import StopRequested
    from diloco.worker.train import train

    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    forget_group(cfg.comm.run_id)
    group = group_for(cfg.comm.run_id, workers)
    states = ["running"] * workers
    failures: dict[int, Failure] = {}

    def run_worker(index: int) -> None:
        worker_cfg = copy.deepcopy(cfg)
        worker_cfg.worker.index, worker_cfg.worker.count, worker_cfg.worker.threads = index, workers, 0
        try:
            group.wait_turn(index)  # torch's RNG is global: set-up must take turns like the steps do
            train(worker_cfg)
            states[index] = "done"
        except Exception as error:
            if not isinstance(error, UserError | StopRequested):  # a bug: its traceback in the log
                logger.exception("worker %d failed", index)
            failures[index] = failure_of_exception(error)
            states[index] = "failed"
        finally:
            group.finish(index)

    for i in range(workers):
        mark_start(run_dir, i)  # this run's records follow; a worker that writes none failed
    threads = [threading.Thread(target=run_worker, args=(i,), daemon=True, name=f"worker-{i}") for i in range(workers)]
    for thread in threads:
        thread.start()
    if show_progress:
        _watch(_Progress(run_dir, workers), cfg.inner.steps, lambda: list(states))
    for thread in threads:
        thread.join()
    forget_group(cfg.comm.run_id)
    return failures


def run_simulated(cfg: Config, *, workers: int) -> int:
    """``diloco local ... comm.backend=simulator``: simulate, show progress, print the summary and
    each failed worker's error; the exit code (``outcome.py``)."""
    print(
        f"run directory:  {cfg.run_dir}   ({workers} simulated workers taking turns, {torch.get_num_threads()} threads)"
    )
    logging.getLogger("diloco.worker.records").setLevel(logging.WARNING)  # the progress lines say it
    return _report(cfg, _simulate(cfg, workers, show_progress=True))


def start_bootstrap(*, host: str, timeout_s: float, log: Path, run_key: str = "") -> tuple[Child, list[str]]:
    """A ``diloco bootstrap`` child listening on ``host`` (a child, so that it, too, dies with the
    launcher), holding the run key if there is one, writing to ``log`` (appended); returns it and
    the address it prints there. Forked warm when that is at once (``warm_start.starts_at_once``),
    as the workers are: a fresh one spends seconds on imports, and again on its interpreter's
    teardown when stopped."""
    command = [sys.executable, "-m", "diloco.cli", "bootstrap", "--host", host, "--port", "0"]
    offset = log.stat().st_size if log.exists() else 0  # what an earlier run of this directory left
    env = {RUN_KEY_ENV: run_key} if run_key else None
    # a warm server that is up forks it at once; until then a fresh interpreter is up sooner
    start = start_child if warm_start.starts_at_once() else start_fresh
    with log.open("ab") as out:
        process = start(command, out, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        with log.open("rb") as written:
            written.seek(offset)
            for line in written.read().decode(errors="replace").splitlines():
                if "initial_peers=['" in line and "']" in line:  # a whole line, not one half written
                    return process, [line.split("['", 1)[1].split("']", 1)[0]]
        time.sleep(0.05)  # polling the file the bootstrap peer writes its address to
    exited = process.poll()
    stop_all([process])
    if exited is not None:
        raise CommError(f"the bootstrap peer exited (code {exited}); see {log}")
    raise CommError(
        f"the bootstrap peer did not start within {timeout_s:.0f} s (comm.hivemind.startup_timeout_s); see {log}"
    )


def _state(child: Child) -> str:
    code = child.poll()
    return "running" if code is None else ("done" if code == 0 else f"exit {code}")
