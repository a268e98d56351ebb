"""What a worker records, one call per event: the JSONL line (the contract benchmarks and plots
read), the wandb point, and the console line.

Record fields: a ``start`` record when the worker's records open (a session: a rerun appends to
the same file; a launcher writes one too, before it starts the worker), ``step`` records every
``logging.log_every`` inner steps and at the first step of the session (progress shows at once),
``round`` records after every outer sync, one ``end`` record when the worker finishes; a ``resume``
record when it resumed (from which checkpoint, and which of its own were damaged).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from diloco.comm.base import Outcome, SyncResult
from diloco.config import LoggingConfig
from diloco.worker.metrics import JsonlWriter, build_wandb_logger, format_duration, start_record

logger = logging.getLogger(__name__)


@dataclass
class Totals:
    """Running totals of one worker, kept in its checkpoint so a resumed run continues them."""

    compute_s: float = 0.0  # time inside inner steps
    comm_wait_s: float = 0.0  # time blocked in the outer sync
    bytes_sent: int = 0
    bytes_recv: int = 0
    wall_s: float = 0.0  # training time before this process (resumed runs)
    peak_sync_bytes: int = 0  # the most bytes sent by one sync (streaming sends a fragment at a time)

    def add_round(self, result: SyncResult, comm_s: float) -> None:
        self.comm_wait_s += comm_s
        self.bytes_sent += result.bytes_sent
        self.bytes_recv += result.bytes_recv
        self.peak_sync_bytes = max(self.peak_sync_bytes, result.bytes_sent)


class WorkerLog:
    def __init__(
        self,
        cfg: LoggingConfig,
        *,
        run_dir: Path,
        run_name: str,
        worker_index: int,
        total_steps: int,
        tokens_per_step: int,
        config_dict: dict,
        wall_s_before: float = 0.0,
    ):
        self.worker_index, self.total_steps, self.tokens_per_step = worker_index, total_steps, tokens_per_step
        self.jsonl = JsonlWriter(run_dir, worker_index)
        self.jsonl.log({**start_record(worker_index), "total_steps": total_steps})  # the run's length, for progress
        self.wandb = build_wandb_logger(
            cfg, run_dir=run_dir, run_name=run_name, worker_index=worker_index, config_dict=config_dict
        )
        self.started = time.perf_counter() - wall_s_before
        self._window_start, self._window_steps = time.perf_counter(), 0
        self._eta_from: tuple[int, float] | None = None  # (step, time) of this process's first step record
        self._stepped = False  # whether this process wrote a step record yet (its first step writes one)
        # the record of the step just counted (its head, its measured figures), until the loop's figures come
        self._pending: tuple[dict, dict] | None = None
        # the latest figures, for the worker's roster record (``diloco status``); replaced, never changed
        self.live: dict = {}

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def discount(self, seconds: float) -> None:
        """Leave ``seconds`` out of the wall clock (time a simulated worker spent waiting for its turn)."""
        self.started += seconds

    def _emit(self, record: dict, step: int) -> None:
        self.jsonl.log(record)
        self.wandb.log(record, step=step)

    def resume(self, record: dict, line: str) -> None:
        """How the worker resumed (resume.py): its record and one console line, a warning when
        some of its checkpoints were damaged."""
        self._emit({"event": "resume", **record}, record["step"])
        logger.log(logging.WARNING if record["damaged"] else logging.INFO, "%s", line)

    def count_step(self, step: int, round_index: int, *, due: bool) -> None:
        """Count inner step ``step``, just taken. When ``due`` (and at this process's first step) its
        record is begun: its throughput is measured now, before any round the step ends, and it is
        written with the loop's figures (``write_step``) or, should the loop give none, at the
        next step."""
        self.flush_step()
        self._window_steps += 1
        if not due and self._stepped:
            return
        self._stepped = True
        if torch.cuda.is_initialized():  # the window ends when the device's queued steps are done
            torch.cuda.synchronize()
        tokens_per_s = self._window_steps * self.tokens_per_step / (time.perf_counter() - self._window_start)
        head = {"event": "step", "step": step, "round": round_index}
        measured = {"tokens_per_s": round(tokens_per_s, 1), "time_s": round(self.elapsed_s(), 4)}
        self._pending = (head, measured)
        self.restart_window()

    def write_step(self, figures: dict) -> None:
        """The loop's ``figures`` of the step just counted (its loss, lr, ...: tensors are read
        here, only when a record is due), written with its record; nothing when none is due."""
        if self._pending is None:
            return
        (head, measured), self._pending = self._pending, None
        record = {**head, **{key: _number(value) for key, value in figures.items()}, **measured}
        self._emit(record, record["step"])
        self.live = {**self.live, "tokens_per_s": record["tokens_per_s"]}
        loss = record.get("loss")
        if isinstance(loss, float):
            self.live["loss"] = round(loss, 4)
        logger.info(
            "step %d/%d  round %d%s  %.0f tokens/s  ETA %s",
            record["step"],
            self.total_steps,
            record["round"],
            f"  loss {loss:.4f}" if isinstance(loss, float) else "",
            record["tokens_per_s"],
            self._eta(record["step"]),
        )

    def flush_step(self) -> None:
        """Write a begun step record the loop gave no figures for."""
        self.write_step({})

    def _eta(self, step: int) -> str:
        """Time left at this process's pace so far (syncs and evaluation included)."""
        if self._eta_from is None:
            self._eta_from = (step, time.perf_counter())
            return "-"
        first_step, started = self._eta_from
        done = step - first_step
        seconds = (time.perf_counter() - started) / done * (self.total_steps - step) if done else 0.0
        return format_duration(seconds)

    def restart_window(self) -> None:
        """Throughput windows exclude syncs and evaluation."""
        self._window_start, self._window_steps = time.perf_counter(), 0

    def round(
        self,
        round_number: int,
        step: int,
        result: SyncResult,
        *,
        comm_s: float,
        recovered: bool,
        val_loss: float | None,
        param_hash: str,
        phases_s: dict[str, float] | None = None,
        eval_batches: int | None = None,
    ) -> None:
        if self._pending is not None and self._pending[0]["step"] < step:  # the round skipped ahead: in step order
            self.flush_step()
        record = {
            "event": "round",
            "round": round_number,
            "step": step,
            "val_loss": val_loss,
            "peers": result.peers,
            "outcome": result.outcome.value,  # what the round produced (comm/round_result.py)
            "ok": result.ok,
            "partial": result.outcome is Outcome.PARTIAL,
            "recovered": recovered,
            "bytes_sent": result.bytes_sent,
            "bytes_recv": result.bytes_recv,
            "comm_s": round(comm_s, 4),
            "param_sha256": param_hash,
            "tokens": step * self.tokens_per_step,
            "time_s": round(self.elapsed_s(), 4),
        }
        if phases_s:  # seconds in each phase since the last record (watchdog.py): where the round went
            record["phases_s"] = {name: round(seconds, 4) for name, seconds in phases_s.items()}
        if eval_batches is not None:  # the held-out batches this worker evaluated itself (shared: its share)
            record["eval_batches"] = eval_batches
        record.update(_outcome_fields(result))
        self._emit(record, step)
        self.live = {**self.live, "val_loss": None if val_loss is None else round(val_loss, 4), "peers": result.peers}
        self.live["excluded"] = list(result.excluded)  # for diloco status (empty again once none is)
        logger.info(
            "round %d:%s  peers %d  %.2f s  %d bytes sent%s  params %s",
            round_number,
            "" if val_loss is None else f" val_loss {val_loss:.4f}",
            result.peers,
            comm_s,
            result.bytes_sent,
            f" ({result.codec})" if result.codec else "",
            param_hash[:12],
        )
        self.restart_window()

    def end(
        self, step: int, rounds: int, totals: Totals, *, val_loss: float | None, param_hash: str, param_count: int = 0
    ) -> dict:
        self.flush_step()
        record = {
            "event": "end",
            "worker": self.worker_index,
            "inner_steps": step,
            "rounds": rounds,
            "tokens": step * self.tokens_per_step,
            "val_loss": val_loss,
            "bytes_sent": totals.bytes_sent,
            "bytes_recv": totals.bytes_recv,
            "peak_sync_bytes": totals.peak_sync_bytes,
            "compute_s": round(totals.compute_s, 3),
            "comm_wait_s": round(totals.comm_wait_s, 3),
            "wall_s": round(self.elapsed_s(), 3),
            "param_count": param_count,
            "peak_rss_bytes": peak_rss_bytes(),
            "peak_gpu_bytes": peak_gpu_bytes(),
            "param_sha256": param_hash,
        }
        self._emit(record, step)
        return record

    def close(self) -> None:
        self.flush_step()
        self.jsonl.close()
        self.wandb.finish()


def _number(value):
    """A figure as a record holds it: a tensor (a loss) read as a Python number."""
    return value.item() if hasattr(value, "item") else value


def peak_rss_bytes() -> int:
    """The most resident memory this process has held so far (its high-water mark), in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def peak_gpu_bytes() -> int:
    """The most GPU memory PyTorch's allocator has held for tensors in this process (0 without CUDA)."""
    return torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0


def totals_state(totals: Totals, log: WorkerLog) -> dict:
    """Totals as saved in a checkpoint (with the wall time so far)."""
    return {**asdict(totals), "wall_s": log.elapsed_s()}


def _outcome_fields(result: SyncResult) -> dict:
    """What a round record says of ``result`` beyond its figures, where there is something to say."""
    fields: dict = {}
    if result.error:
        fields["error"] = result.error
    if result.codec:  # compression.name=adaptive: the codec the round's peers agreed on
        fields["codec"] = result.codec
    if result.averaged and result.peers < result.expected:  # fewer than the live workers the round waited for
        fields["expected"] = result.expected
    if result.missing:  # workers gone without leaving: crashed, or cut off (a split run)
        fields["missing"] = list(result.missing)
    if result.sides:  # the group held several models (a split run met again): workers of each, ours first
        fields["sides"] = list(result.sides)
    if result.excluded:  # workers left out of every mean now (comm.exclude_after)
        fields["excluded"] = list(result.excluded)
    if result.outcome is Outcome.POSTPONED:  # nobody could reduce: no outer step; the steps count toward the next round
        fields["postponed"] = True
    return fields
