"""diloco: DiLoCo training across machines joined by slow, unreliable links.

Workers each run many local (inner) optimizer steps on their own data shard, then average
their pseudo-gradients with their peers and apply an outer optimizer (DiLoCo,
arXiv:2311.08105). Where things live:

- ``config.py``      the typed schema and ``load_config`` (defaults <- YAML <- CLI overrides)
- ``config_reference.py`` the configuration reference table (docs/configuration.md, ``diloco config --reference``)
- ``train.py``       the worker loop, top to bottom, readable like the algorithm
- ``outer.py``       pseudo-gradients and the outer optimizer: **the outer step happens here**
- ``overlap.py``     outer steps overlapped with compute (delayed, streaming fragments)
- ``inner.py``       the inner step (bf16 autocast) and its optimizer (AdamW, fused on CUDA), the lr schedule
- ``transfer.py``    the outer step's copies between the model's device and (pinned) host memory
- ``rounds.py``      when a round ends: every H steps, or a time budget (dynamic local steps)
- ``site.py``        several torchrun ranks as one worker: data-parallel inside, rank 0 syncs across sites
- ``placement.py``   where a worker's model lives: one process, a site's replicas, or a site's shards
- ``joining.py``     a newcomer or a restarted worker takes a live peer's state before its first round
- ``comm/``          how pseudo-gradients travel: ``CommBackend``; hivemind, simulated, torchrun;
                     who is in the run (roster), the run key, robust aggregation
- ``compression/``   codecs on the wire (fp16, int8, int4, top-k) and error feedback
- ``model.py``       the model config; a small GPT for tests and demos
- ``hf_model.py``    a Hugging Face causal LM (presets, a config.json, local weights) behind GPT's interface
- ``data.py``        a corpus of tokens (bytes by default), disjoint per-worker shards, held-out split
- ``hf_data.py``     a local Hugging Face dataset and tokenizer feeding data.py's token tensor
- ``hf_extra.py``    the optional ``hf`` extra: is it installed, and the one-line error when it is not
- ``token_cache.py`` a dataset streamed once into a memory-mapped token file (corpora larger than memory)
- ``checkpoint.py``  atomic save / load of everything a worker needs to resume
- ``metrics.py``     the sinks (JSONL file, wandb) and the run summary
- ``worker_log.py``  what a worker records per event: the JSONL line, the wandb point, the console line
- ``plot.py``        ``diloco plot``: loss against tokens, wall time and bytes for runs
- ``local.py``       runs a bootstrap peer and M workers on one machine, with a live view
- ``status.py``      ``diloco status``: a live run's workers, read from the roster on the DHT
- ``faults.py``      fault injection at named points (skip a round, stop, bad payloads, slow steps)
- ``testbed.py``     network namespaces on shaped links (root)
- ``bench/``         ``diloco bench overhead / quality / compression / utilization / faults / gpu``
- ``cli.py``         the ``diloco`` command
"""

__version__ = "0.1.0"
