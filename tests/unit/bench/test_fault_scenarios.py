"""The fault scenarios' timing (``diloco/bench/faults.py``): where a split run's next cut lands."""

from __future__ import annotations

import pytest

from diloco.bench.faults import next_mid_round


@pytest.mark.parametrize(
    "step, cut",
    [
        (100, 110),  # round 5 (steps 81-100) just ended: the middle of round 6
        (105, 110),  # inside round 6, before its middle: that middle
        (110, 130),  # round 6's middle reached: round 7's
        (119, 130),
        (120, 130),
    ],
)
def test_the_next_cut_is_the_first_middle_of_a_round_past_the_step(step, cut):
    assert next_mid_round(step, 20) == cut
