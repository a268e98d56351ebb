"""Outer rules that set more than the outer optimizer: the defaults they bring to other sections.

``outer.optimizer=sparseloco`` (SparseLoCo, arXiv:2508.15706) is DiLoCo whose outer momentum is
replaced by each worker's error feedback with decay: a worker keeps ``e <- beta e + delta``,
sends the chunk-wise top-k of ``e`` (2-bit values by default), keeps ``e <- e - sent``; the sparse
contributions are all-gathered and averaged value by value over the workers that sent each value
(not sparsified again) and the global params take a plain step of ``outer.lr``. So the one key stands for::

    outer.lr=1.0  compression.name=topk  compression.topk_mean=senders
    compression.error_feedback=true  compression.error_decay=0.95

each of which a YAML file or an override still sets (``compression.topk_k``, ``topk_chunk``:
the density, 64 of 4,096 by default; ``topk_value_bits``: 2). These defaults sit between the dataclasses' and the
user's layers in ``load_config``, so a file that sets every key (the ``config.yaml`` a run
writes) keeps its own: run SparseLoCo from such a file with the rule's keys set as overrides.
``outer.momentum`` is not used by it; ``outer.sparseloco_momentum`` above 0 (0 by default) makes
the step Nesterov's over the averaged sparse update (the same on every peer, so it needs no
traffic): docs/compression.md has the settings measured best.
"""

from __future__ import annotations

RULE_DEFAULTS: dict[str, dict] = {
    "sparseloco": {
        "outer": {"lr": 1.0},
        "compression": {"name": "topk", "topk_mean": "senders", "error_feedback": True, "error_decay": 0.95},
    },
}


def rule_defaults(outer_optimizer: str) -> dict:
    """The defaults ``outer.optimizer=outer_optimizer`` brings to other sections (empty for most)."""
    return RULE_DEFAULTS.get(outer_optimizer, {})
