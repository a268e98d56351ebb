"""Outer rules that set more than the outer optimizer: the defaults they bring to other sections.

``outer.optimizer=sparseloco`` (SparseLoCo, arXiv:2508.15706) is DiLoCo whose outer momentum is
replaced by each worker's error feedback with decay: a worker keeps ``e <- beta e + delta``,
sends the chunk-wise top-k of ``e`` (2-bit values by default), keeps ``e <- e - sent``; the sparse
contributions are all-gathered and averaged value by value over the workers that sent each value
(not sparsified again) and the global params take Nesterov's step of ``outer.lr`` over them (the
same on every peer, so it needs no traffic). The one key stands for the settings measured best
on the quality workload (docs/compression.md)::

    outer.lr=1.0  outer.sparseloco_momentum=0.5  compression.name=topk  compression.topk_k=184
    compression.topk_mean=senders  compression.error_feedback=true  compression.error_decay=0.85

each of which a YAML file or an override still sets; the paper's production settings, for runs
of thousands of rounds, are ``outer.sparseloco_momentum=0 compression.topk_k=64
compression.error_decay=0.95`` (``SPARSELOCO_PAPER``). These defaults sit between the
dataclasses' and the user's layers in ``load_config``, so a file that sets every key (the
``config.yaml`` a run writes) keeps its own: a run resumes and is joined with the settings it
started with. ``outer.momentum`` is not used by it.
"""

from __future__ import annotations

RULE_DEFAULTS: dict[str, dict] = {
    "sparseloco": {
        "outer": {"lr": 1.0, "sparseloco_momentum": 0.5},
        "compression": {
            "name": "topk",
            "topk_k": 184,
            "topk_mean": "senders",
            "error_feedback": True,
            "error_decay": 0.85,
        },
    },
}
# SparseLoCo's settings in the paper (its production runs sync thousands of times), as overrides
SPARSELOCO_PAPER = ("outer.sparseloco_momentum=0", "compression.topk_k=64", "compression.error_decay=0.95")


def rule_defaults(outer_optimizer: str) -> dict:
    """The defaults ``outer.optimizer=outer_optimizer`` brings to other sections (empty for most)."""
    return RULE_DEFAULTS.get(outer_optimizer, {})
