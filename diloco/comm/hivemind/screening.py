"""Robust aggregation (``robust.py``) in a round's all-reduce over hivemind.

A reducer sees only a slice of each sender's vector, so each sender declares the norm of its whole
(decoded) contribution in the matchmaking's gathered data (``declared_data``). Every peer screens
the same declared norms alike (``screen_round``): a dropped sender is refused by every reducer
(banned before it sends anything, so nobody waits for it), and drops itself as it would a payload
it cannot decode; with ``comm.clip_to_median`` every reducer scales a sender's parts by the same
factor. A reducer checks what it receives against the declared norm (``check_declared_norm``: the
parts of a vector cannot be longer than the vector) and drops a sender that under-declared, or
whose parts claim another weight than it declared (``check_declared_weight``: the screening's
weight bound and free-rider rule judged the declared one). With ``comm.min_cosine`` above -1 each
sender also declares the sketch of its whole contribution, and every peer judges the sketches
alike (``verdicts.py``: direction; replays, by each peer's own history). The senders its tally
excludes each reducer leaves out of the parts of its share (``reducer.ScreeningReducer``); with a
codec that gathers, it sends only the payloads of the senders it kept.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Mapping

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID

from diloco.comm.hivemind.exclusion import Exclusions
from diloco.comm.robust import Screening, ScreeningRules, declared_norm, declared_sketches, declared_weights, screen
from diloco.comm.verdicts import SketchHistory
from diloco.compression import PayloadError

logger = logging.getLogger(__name__)


def declared_data(serializer, group_info: GroupInfo) -> tuple[dict[PeerID, dict], tuple[AveragingMode, ...]]:
    """What each peer that contributes gathered at matchmaking (as hivemind's own
    ``_aggregate_with_group`` decodes it with ``serializer``: [bandwidth, mode, user data]; an empty
    dict where unreadable: its norm is nan), helpers left out; and every peer's mode. hivemind 1.1.12
    does not hand the modes to its runner, which then takes a helper (an auxiliary peer) for a sender."""
    found, modes = {}, []
    for peer, declared in zip(group_info.peer_ids, group_info.gathered):
        _, mode, user_data = serializer.loads(declared)  # hivemind itself read it so far
        modes.append(AveragingMode(mode))
        if modes[-1] == AveragingMode.AUX:
            continue
        try:
            found[peer] = serializer.loads(user_data)
        except Exception:  # whatever a peer put there, it is not usable
            found[peer] = {}
    return found, tuple(modes)


def screen_round(
    declared: Mapping[PeerID, dict],
    rules: ScreeningRules,
    exclusions: Exclusions,
    *,
    own: PeerID,
    history: SketchHistory | None = None,
) -> tuple[dict, Screening, set]:
    """(each sender's declared norm, the round's screening, the senders our tally excludes): the
    screening of the declared norms, weights and sketches every peer computes alike, then the
    senders our reducer leaves out of its sums (those our tally excludes, and the replays of the
    earlier rounds of ``history``: ``Screening.excluded``); one line per contribution dropped or
    left out."""
    norms = {peer: declared_norm(data) for peer, data in declared.items()}
    round_index, fragment = declared_round(declared, own=own)
    screening = screen(  # the same on every peer
        norms,
        rules,
        declared_weights(declared),
        sketches=declared_sketches(declared) if rules.judges_sketches else None,
        round_index=round_index,
        fragment=fragment,
        history=history,
    )
    excluded = exclusions.of(declared, own=own)  # then the peers our tally excludes
    screening = exclusions.screened(screening, excluded | set(screening.repeated))
    for peer, reason in screening.dropped.items():
        if peer == own:
            logger.warning("dropped our own contribution: %s", reason)
        else:
            logger.warning("dropped the contribution of peer %s: %s", peer, reason)
    for peer, reason in screening.repeated.items():
        logger.warning("left the contribution of peer %s out of the parts we reduce: %s", peer, reason)
    return norms, screening, excluded


def declared_round(declared: Mapping[PeerID, dict], *, own: PeerID) -> tuple[int, int]:
    """(round, fragment) as ``own`` declared them (every honest peer of a group declares the same),
    or, for a helper (which declares none), as most of the contributors did; (0, 0) where none can
    be read."""
    found = [_round_of(declared.get(own))] if own in declared else [_round_of(d) for d in declared.values()]
    found = [value for value in found if value is not None]
    return collections.Counter(found).most_common(1)[0][0] if found else (0, 0)


def _round_of(data: object) -> tuple[int, int] | None:
    value = data.get("round") if isinstance(data, dict) else None
    if isinstance(value, list | tuple) and len(value) == 2 and all(type(v) is int for v in value):
        return value[0], value[1]
    return None


def check_declared_weight(declared: Mapping, sender: object, weight: float) -> None:
    """Raise PayloadError when ``sender``'s part claims another weight than it declared at
    matchmaking (``declared``: sender -> weight), the one every peer's screening judged alike; a
    sender that declared none claims another. Nothing when no weights were declared at all."""
    if declared and not weight == declared.get(sender, math.nan):
        raise PayloadError(f"its parts claim weight {weight:g}, not the {declared.get(sender, math.nan):g} it declared")


def check_declared_norm(received_squares: dict, norms: Mapping, sender: object, part: torch.Tensor) -> None:
    """Raise PayloadError once the parts of ``sender`` received here (``received_squares``: sender ->
    sum of their squared norms so far, updated with ``part``) are longer than the norm it declared
    for its whole vector (``norms``; 10% for rounding, and a tiny absolute slack)."""
    squares = received_squares.get(sender, 0.0) + float(torch.linalg.vector_norm(part)) ** 2
    received_squares[sender] = squares
    declared = norms.get(sender, math.nan)
    if not math.sqrt(squares) <= 1.1 * declared + 1e-6:
        raise PayloadError(f"its parts have norm {math.sqrt(squares):.4g}, above the {declared:.4g} it declared")
