"""Which state a worker resumes from when its command runs again in a run directory it trained in,
and how that is told: one console line and one ``resume`` record in its ``worker-<i>.jsonl``.

``choose_resume`` holds the policy; ``build_worker`` loads what it chose (build.py) and
``Worker.begin`` tells it once the worker knows where it starts (after a catch-up with a live run).
A damaged checkpoint must not fork the model: a worker that started from step 0 alone while the
others resumed at round 4 would train a model of its own to the end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco.worker.checkpoint import checkpoint_folder, read_newest

_WORKER_DIR_RE = re.compile(r"^worker-(\d+)$")

# what a worker takes of another worker's checkpoint: at a round's end every worker of the run
# holds the same global params and outer-optimizer state (and, with blocking rounds, the same
# model), so these are the run's; the totals stand in for its own (the same rounds, alike counts)
_TAKEN = ("model", "inner_optimizer", "outer", "overlap", "step", "round", "totals")


@dataclass
class Resume:
    """Where a worker's state comes from. ``source``: ``own`` (its newest checkpoint), ``own_older``
    (an older one of its own: newer ones are damaged), ``worker <j>`` (another worker's), ``fresh``
    (nothing usable on disk: the seed's initial state); ``Worker.begin`` adds ``live run`` (it caught up
    with peers rounds ahead). ``damaged``: its own files that did not read whole, with why."""

    source: str
    state: dict | None = None
    path: Path | None = None  # the checkpoint the state was read from
    damaged: dict[Path, str] = field(default_factory=dict)

    @property
    def own(self) -> bool:
        """Whether the state is this worker's own (its data position and RNG with it)."""
        return self.source in ("own", "own_older")


def choose_resume(checkpoints: Path, worker_index: int, *, model_shapes: dict[str, tuple] | None) -> Resume:
    """The newest usable state this worker can resume from; at a tie, its own.

    1. Its own newest checkpoint that reads whole (``own``; ``own_older`` when newer ones are
       damaged): a worker whose files are whole resumes from its newest, as it always did.
    2. Only when its own newest is damaged: the newest whole checkpoint of another worker of the
       run (``checkpoints/worker-<j>/``) at a round past its own usable one, and whose model has
       this worker's keys and shapes (``model_shapes``; None, a site's rank: never another's,
       as each rank holds its own part and the ranks must resume alike). It takes ``_TAKEN``;
       its error feedback starts empty (another's residual is that worker's unsent
       pseudo-gradient: it would be sent twice); its data position is rebuilt on its own shard
       as far along as the other's (``ShardSampler.skip``); its RNG (dropout) stays its own
       seed's. The inner optimizer's moments are the other's: of the same model on data alike,
       a closer stand-in than zeros, which would make the first steps full-size sign steps.
    3. Otherwise nothing (``fresh``): a blocking worker whose peers are live and rounds ahead
       then takes their state (joining.py); one with no state anywhere starts afresh, said in a
       warning when it had damaged files.
    """
    found, damaged = read_newest(checkpoints, worker_index)
    own_round = found[0] if found else -1
    if damaged and model_shapes is not None:
        other = _newest_of_others(checkpoints, worker_index, newer_than=own_round, model_shapes=model_shapes)
        if other is not None:
            return Resume(f"worker {other[0]}", _taken(other[2]), other[1], damaged)
    if found is None:
        return Resume("fresh", damaged=damaged)
    return Resume("own_older" if damaged else "own", found[2], found[1], damaged)


def _newest_of_others(
    checkpoints: Path, worker_index: int, *, newer_than: int, model_shapes: dict[str, tuple]
) -> tuple[int, Path, dict] | None:
    """(worker, path, state) of the newest whole checkpoint of another worker past round
    ``newer_than`` with this model's shapes; the lowest worker index at a tie. Another worker's
    damaged files are not this worker's to tell: they are passed over."""
    best = None
    for other in _other_workers(checkpoints, worker_index):
        found, _ = read_newest(checkpoints, other, newer_than=newer_than)
        if found is not None and _shapes(found[2]) == model_shapes:
            best, newer_than = (other, found[1], found[2]), found[0]
    return best


def _other_workers(checkpoints: Path, worker_index: int) -> list[int]:
    folders = Path(checkpoints).iterdir() if Path(checkpoints).is_dir() else []
    found = (int(m.group(1)) for folder in folders if (m := _WORKER_DIR_RE.match(folder.name)))
    return sorted(i for i in found if i != worker_index and checkpoint_folder(checkpoints, i).is_dir())


def _shapes(state: dict) -> dict[str, tuple] | None:
    model = state.get("model")
    return {key: tuple(value.shape) for key, value in model.items()} if isinstance(model, dict) else None


def model_shapes(model: torch.nn.Module) -> dict[str, tuple]:
    """The keys and shapes of ``model``'s state dict, as ``choose_resume`` compares them."""
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def _taken(state: dict) -> dict:
    """What this worker takes of another worker's checkpoint (``choose_resume``, 2.)."""
    taken = {key: state[key] for key in _TAKEN if key in state}
    others = {key: value for key, value in state.items() if key not in (*_TAKEN, "error_feedback", "rng")}
    return {**taken, "error_feedback": {}, **others}  # the user's own parts, read but not loaded (not its own)


def told(resume: Resume, worker_index: int, *, step: int, round_index: int, caught_up: bool) -> tuple[dict, str] | None:
    """The ``resume`` record and its one console line, once the worker knows where it starts,
    (``step``, ``round_index``); ``caught_up``: it took a live peer's state there, rounds ahead of
    what it resumed from. None for a worker that had nothing on disk (a new one, a newcomer)."""
    if resume.source == "fresh" and not resume.damaged:
        return None
    record = {
        "source": "live run" if caught_up else resume.source,
        "round": round_index,
        "step": step,
        "damaged": [f"{path.parent.name}/{path.name}" for path in resume.damaged],
        "checkpoint": f"{resume.path.parent.name}/{resume.path.name}" if resume.path else None,
    }
    if resume.state is not None:
        whose = {"own": "its", "own_older": "its older"}.get(resume.source, f"{resume.source}'s")
        at = f"step {resume.state['step']}, after round {resume.state['round']}"
        done = f"resumed at {at}, from {whose} checkpoint {resume.path.name}"
    else:
        done = "no whole checkpoint of its own or of another worker"
    if caught_up:
        done += f"{', then' if resume.state else ';'} took the live run's state after round {round_index} (step {step})"
    elif resume.state is None:
        done += ", and took no live run's state: STARTS AFRESH at step 0"
    separator = ": " if resume.damaged else " "
    return record, f"worker {worker_index}{separator}{_damage(resume.damaged)}{done}"


def _damage(damaged: dict[Path, str]) -> str:
    """What was wrong with this worker's own files (newest first), as the start of its line."""
    if not damaged:
        return ""
    (newest, reason), *older = damaged.items()
    if not older:
        return f"its newest checkpoint {newest.name} is damaged ({reason}); "
    names = ", ".join(path.name for path in damaged)
    return f"its checkpoints {names} are damaged ({newest.name}: {reason}); "
