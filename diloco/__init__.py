"""diloco: DiLoCo training across machines joined by slow, unreliable links.

Around a user's own model and loop (docs/api.md)::

    import diloco
    run = diloco.init()                                  # diloco launch's environment, a file or keywords
    with diloco.DiLoCo(run, model, inner_optimizer) as dl:
        while dl.running:
            ...; inner_optimizer.step()                  # every outer.sync_every steps: a round
            dl.log(loss=loss)

Workers each run many local (inner) optimizer steps on their own data shard, then average
their pseudo-gradients with their peers and apply an outer optimizer (DiLoCo,
arXiv:2311.08105). Where things live, from the top down: a package imports only those below
it, and import-linter contracts in ``pyproject.toml`` keep it so:

- ``cli.py``          the ``diloco`` command
- ``bench/``          ``diloco bench overhead / quality / compression / utilization / faults / nat / scale / gpu /
                      gpu-train``
- ``tools/``          the local launcher (``diloco local``) and its warm start (workers forked from a
                      process that imported torch and hivemind once), the network testbed, ``diloco status``,
                      ``diloco plot``, ``diloco corpus``, a volunteer's way into a live run (``diloco join``),
                      the bootstrap peer
- ``hf.py``           a ``transformers.Trainer`` script as a worker (``DiLoCoCallback``, the ``hf`` extra)
- ``worker/``         one worker at run time: ``DiLoCo`` around a model and its loop (``wrapper.py``)
                      and the run it trains in (``run.py``, ``init()``); ``train.py``, ``diloco
                      train``'s loop, its first user, read top to bottom; how rounds
                      sync (blocking, overlapped, data-parallel: ``sync_modes.py``); placement (one
                      process, a site's replicas or its shards); joining a live run; checkpoints; records and
                      metrics; the watchdog; memory checks; fault injection
- ``config/``         the typed schema, ``load_config`` (defaults <- YAML <- CLI overrides), the checks
                      across sections, and the reference table (docs/configuration.md)
- ``core/``           the algorithm: inner steps, pseudo-gradients and the outer optimizer
                      (``core/outer.py``: **the outer step happens here**), overlapped outer steps,
                      what a worker does after a failed, partial or split round and when it starts
                      behind the run (``core/recovery.py``: **recovery happens here**), when a round
                      ends, the outer step's host copies, evaluation (``evaluation.py``; split among
                      the workers that hold the same params: ``shared_evaluation.py``)
- ``models/``         a small GPT (``gpt.py``) and Hugging Face causal LMs (``hf.py``) behind one interface;
                      their settings (``config.py``)
- ``data/``           what a corpus is read from (``source.py``, a leaf); a corpus of tokens, per-worker shards, the
                      held-out split; Hugging Face datasets; a token cache;
                      the installed packages' Python source as a corpus, and its BPE tokenizer
- ``comm/``           how pseudo-gradients travel: a transport (``CommBackend``, ``base.py``) is its
                      averaging, state exchange and membership, and a board of held-out losses;
                      its settings (``config.py``); the reduce rule (``reduce.py``);
                      hivemind (``comm/hivemind/``: its peer, **a round is averaged in**
                      ``averaging.py`` and ``group_round.py``, the state exchange, the roster, the
                      averager and its bit-exact all-reduce, codecs on the wire, screening, traffic
                      counters and state serving each in a module, the gloo data plane, the run key,
                      its settings; every hivemind method it overrides is listed in ``overrides.py``),
                      simulated, torchrun; a site's transport (``sites.py``: several GPUs as one
                      worker); robust
                      aggregation and the scores that exclude a worker; the bound of every wait
- ``compression/``    codecs on the wire (fp16, int8, int4, top-k) and error feedback
- ``optional_deps.py`` whether an optional dependency (the ``hf`` extra) is installed; the line
                      that says how to get it
- ``lifetime.py``     child processes that die with their parent
- ``errors.py``       every error a user has to fix, one line each
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["DiLoCo", "Run", "init"]

# the library's names, imported when first used: ``import diloco.config`` stays light
_EXPORTS = {"DiLoCo": "diloco.worker.wrapper", "Run": "diloco.worker.run", "init": "diloco.worker.run"}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'diloco' has no attribute {name!r}")
