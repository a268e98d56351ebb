"""How far a run trusts its workers (``comm.trust``), and the screening defaults each level brings.

The screening of contributions (``comm/robust.py``) has knobs of its own; ``comm.trust`` is the one
key a run's organizer sets to say who the workers are, and it picks them:

- ``trusted`` (the default): one operator's machines, or sites and labs that trust each other.
  Every run applies the rules against faults (non-finite payloads dropped, ``comm.max_norm_ratio``,
  ``comm.max_weight_ratio``, ``comm.exclude_after``); no contribution is second-guessed by its
  direction, which the gloo data plane, ``comm.backend=torchdist`` and the data-parallel baseline
  need.
- ``open``: anyone who reaches the run may join, and any worker may send garbage or attack: the
  direction rule (``comm.min_cosine=0``: a contribution that points against the others' median is
  left out) and the clip of every contribution to the round's median norm
  (``comm.clip_to_median=true``) come on as well.
- ``keyed``: as ``open``, and the run refuses to start without its key (``comm.run_key`` or
  ``$DILOCO_RUN_KEY``): strangers are kept out, the key holders are screened.

Screening is not the default because it has a cost that grows as a model shrinks: a hivemind
reducer judges each part of a vector alone, and on a small model whose loss has flattened, honest
parts point every which way (below cosine 0 in most late rounds of the tests' 0.12M-parameter model),
which leaves them out and makes the round partial.

Like an outer rule's defaults (``config/rules.py``) these sit between the dataclasses' defaults and
the user's layers in ``load_config``: a screening key set in a YAML file or an override wins, and a
run's written ``config.yaml`` (which sets every key) resumes with what it ran. A trust level given
on the command line also outranks the screening keys of the file it overrides (``diloco train
runs/x/config.yaml comm.trust=open`` screens). ``diloco join`` and ``diloco helper`` take the run's
config, its trust level with it, from a live peer; a volunteer's own config file must agree with
the run's on it (``worker/joining.py``'s ``run_identity``).
"""

from __future__ import annotations

from diloco.comm import CommConfig

TRUST_LEVELS = ("trusted", "keyed", "open")
SCREENED = {"comm": {"min_cosine": 0.0, "clip_to_median": True}}
UNSCREENED = {"comm": {"min_cosine": CommConfig.min_cosine, "clip_to_median": CommConfig.clip_to_median}}


def trust_defaults(trust: str) -> dict:
    """The screening settings of ``comm.trust=trust``, nested like the config (none for an unknown
    level, which the config check names)."""
    return {"open": SCREENED, "keyed": SCREENED, "trusted": UNSCREENED}.get(trust, {})
