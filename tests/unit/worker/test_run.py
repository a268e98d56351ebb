"""``diloco.init()``'s run: the shard of the data each process of a run trains on."""

from __future__ import annotations

from diloco.config import load_config
from diloco.worker.run import Run


def test_each_slot_of_a_run_open_to_volunteers_has_a_shard_of_its_own():
    shards = set()
    for index in range(8):  # 2 planned workers, 6 more slots for volunteers (worker.index 2..7)
        run = Run.from_config(load_config(None, ["worker.count=2", "worker.slots=8", f"worker.index={index}"]))
        assert 0 <= run.data_index < run.data_count == 8
        shards.add(run.data_index)
    assert shards == set(range(8))


def test_a_run_without_slots_has_one_shard_per_worker():
    run = Run.from_config(load_config(None, ["worker.count=3", "worker.index=2"]))
    assert (run.data_index, run.data_count) == (2, 3)
