"""What a reducer checks of a sender's parts against what the sender declared at matchmaking."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.comm.hivemind.screening import check_declared_norm, check_declared_weight
from diloco.compression import PayloadError


def test_a_part_that_claims_another_weight_than_its_sender_declared_is_refused():
    declared = {"a": 12.0, "b": 12.0, "silent": float("nan")}
    check_declared_weight(declared, "a", 12.0)  # as declared
    check_declared_weight({}, "a", 1000.0)  # nothing declared to us: nothing to compare with
    for sender, weight in (("b", 1000.0), ("silent", 12.0), ("stranger", 12.0)):
        with pytest.raises(PayloadError, match=f"its parts claim weight {weight:g}, not the"):
            check_declared_weight(declared, sender, weight)


def test_parts_longer_together_than_the_declared_norm_are_refused_once_they_are():
    squares: dict = {}
    norms = {"a": 5.0, "silent": math.nan}
    check_declared_norm(squares, norms, "a", torch.tensor([3.0]))  # 3 of 5 so far
    check_declared_norm(squares, norms, "a", torch.tensor([4.0]))  # 5 of 5: all of it
    with pytest.raises(PayloadError, match="its parts have norm 6.403, above the 5 it declared"):
        check_declared_norm(squares, norms, "a", torch.tensor([4.0]))
    with pytest.raises(PayloadError, match="above the nan it declared"):
        check_declared_norm(squares, norms, "silent", torch.tensor([0.0]))
