"""One worker at run time: DiLoCo around a model and its loop, ``diloco train``'s own loop, and
what a worker keeps and records.

- ``wrapper.py``     ``diloco.DiLoCo``: around a model, its inner optimizer and any loop
- ``round_end.py``   its steps and rounds; at each round's end the average, the outer step, the
                     evaluation, the record, the checkpoint; at the run's end the end record
- ``run.py``         ``diloco.init()``: the run a process trains in (its config, its placement)
- ``train.py``       ``diloco train``'s worker: its loop inside ``DiLoCo``, top to bottom
- ``lm_task.py``     what ``diloco train`` trains: its corpus shard, its GPT or HF model, its optimizer
- ``build.py``       a worker set up around a model (outer step, codec, resumed state, transport, records)
- ``sync_modes.py``  how its rounds sync: blocking, overlapped or data-parallel, one interface
- ``placement.py``   where a worker's model lives: one process, a site's replicas, or a site's shards
                     (FSDP2); a site's transport is comm/sites.py
- ``joining.py``     a newcomer or a restarted worker takes a live peer's state before its first round
- ``checkpoint.py``  atomic save / load of everything a worker needs to resume, written off the loop
- ``resume.py``      which state a restarted worker resumes from (its own, or another worker's when its own is damaged)
- ``records.py``     what a worker records per event: the JSONL line, the wandb point, the console line
- ``metrics.py``     the sinks (JSONL file, wandb) and the run summary
- ``watchdog.py``    the worker's phases, their bounds, and thread stacks when one is passed
- ``memory.py``      whether a model fits before it is built
- ``faults.py``      fault injection at named points (skip a round, stop, bad payloads, slow steps)
"""
