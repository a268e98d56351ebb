"""How far a run trusts its workers (``comm.trust``), and the screening defaults each level brings.

The screening of contributions (``comm/robust.py``) has knobs of its own; ``comm.trust`` is the one
key a run's organizer sets to say who the workers are, and it picks them:

- ``trusted``: one operator's machines, or sites and labs that trust each other.
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

Without ``comm.trust`` the level follows from who can reach the run (``default_trust``): a
hivemind run that others can reach (it listens on, announces, or dials a non-loopback address)
is ``open``; a run only this machine reaches (loopback, the simulator, torch.distributed), sites,
the gloo data plane and the data-parallel baseline are ``trusted``. The level is then written into
the run's config, so a resume, a ``diloco join`` and a helper take it as the run's.

Like an outer rule's defaults (``config/rules.py``) these sit between the dataclasses' defaults and
the user's layers in ``load_config``: a screening key set in a YAML file or an override wins, and a
run's written ``config.yaml`` (which sets every key) resumes with what it ran. A trust level given
on the command line also outranks the screening keys of the file it overrides (``diloco train
runs/x/config.yaml comm.trust=open`` screens). ``diloco join`` and ``diloco helper`` take the run's
config, its trust level with it, from a live peer; a volunteer's own config file must agree with
the run's on it (``worker/joining.py``'s ``run_identity``).
"""

from __future__ import annotations

import ipaddress

from diloco.comm import CommConfig
from diloco.comm.run_key_env import resolve_run_key

TRUST_LEVELS = ("trusted", "keyed", "open")
FROM_REACH = ""  # comm.trust's default: the level follows from who can reach the run
SCREENED = {"comm": {"min_cosine": 0.0, "clip_to_median": True}}
UNSCREENED = {"comm": {"min_cosine": CommConfig.min_cosine, "clip_to_median": CommConfig.clip_to_median}}


def trust_defaults(trust: str) -> dict:
    """The screening settings of ``comm.trust=trust``, nested like the config (none for an unknown
    level, which the config check names)."""
    return {"open": SCREENED, "keyed": SCREENED, "trusted": UNSCREENED}.get(trust, {})


def default_trust(cfg) -> tuple[str, str]:
    """The trust level of a run that does not set ``comm.trust`` (``cfg``: the whole config), and
    why, for the log."""
    comm = cfg.comm
    if comm.backend != "hivemind":
        return "trusted", f"comm.backend={comm.backend} runs on this machine or one cluster"
    if cfg.worker.site:
        return "trusted", "the ranks of a site trust each other"
    if comm.hivemind.data_plane == "gloo":
        return "trusted", "comm.hivemind.data_plane=gloo joins sites that trust each other"
    if cfg.outer.sync_every == 0:
        return "trusted", "outer.sync_every=0 averages every step's gradients, too noisy to screen"
    if reach := reached_at(comm.hivemind):
        return "open", f"others can reach this run ({reach})"
    return "trusted", "only this machine can reach this run (it listens on loopback)"


def reached_at(hivemind) -> str:
    """How others reach a hivemind peer with these settings (``comm.hivemind``): the non-loopback
    address it listens on, announces or dials; "" when it keeps to this machine."""
    if not _loopback(hivemind.host):
        return f"it listens on {hivemind.host}"
    if hivemind.announce_host and not _loopback(hivemind.announce_host):
        return f"it announces {hivemind.announce_host}"
    for address in hivemind.initial_peers:
        parts = str(address).split("/")
        host = parts[2] if len(parts) > 2 else ""
        if not _loopback(host):
            return f"it dials {address}"
    return ""


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, or anything else: taken as reachable


def trust_line(cfg) -> str:
    """The log line that says which level a run is at, why, and what that screens."""
    level, why = default_trust(cfg)
    if cfg.comm.trust != level:
        why = "set in the run's config"
    if cfg.comm.min_cosine > -1:
        screens = "every contribution is screened by its norm, weight, direction and repetition"
    else:
        screens = "contributions are screened by norm and weight only (set comm.trust=open for more)"
    line = f"comm.trust={cfg.comm.trust} ({why}): {screens}"
    if cfg.comm.backend == "hivemind" and reached_at(cfg.comm.hivemind) and not resolve_run_key(cfg.comm.run_key):
        line += "; the run has no key: anyone who reaches it can join and download its params"
    return line
