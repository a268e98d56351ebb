"""One worker at run time: set-up from the config, the loop, and what it keeps and records.

- ``train.py``       the worker loop, top to bottom, readable like the algorithm
- ``build.py``       a worker set up from its config (data, model, optimizers, resumed state, transport)
- ``sync_modes.py``  how its rounds sync: blocking, overlapped or data-parallel, one interface
- ``placement.py``   where a worker's model lives: one process, a site's replicas, or a site's shards
- ``sites.py``       several torchrun ranks as one worker: data-parallel inside, rank 0 syncs across sites
- ``joining.py``     a newcomer or a restarted worker takes a live peer's state before its first round
- ``checkpoint.py``  atomic save / load of everything a worker needs to resume, written off the loop
- ``resume.py``      which state a restarted worker resumes from (its own, or another worker's when its own is damaged)
- ``records.py``     what a worker records per event: the JSONL line, the wandb point, the console line
- ``metrics.py``     the sinks (JSONL file, wandb) and the run summary
- ``watchdog.py``    the worker's phases, their bounds, and thread stacks when one is passed
- ``memory.py``      whether a model fits before it is built
- ``faults.py``      fault injection at named points (skip a round, stop, bad payloads, slow steps)
"""
