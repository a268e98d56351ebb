"""When rounds end: every H steps, or after a time budget, with the schedule following the clock."""

from __future__ import annotations

import pytest

from diloco.core import rounds
from diloco.core.rounds import RoundClock


def test_fixed_rounds_end_every_h_steps_and_at_the_last_step():
    clock = RoundClock(sync_every=10, round_s=0.0, total_steps=25)
    assert [s for s in range(1, 26) if clock.round_ends(s)] == [10, 20, 25]
    assert clock.running(24, 2) and not clock.running(25, 3)
    assert clock.schedule_step(7, 0) == 7


def test_timed_rounds_end_on_the_clock_and_the_schedule_follows_it(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(rounds.time, "monotonic", lambda: now[0])
    clock = RoundClock(sync_every=10, round_s=4.0, total_steps=30)
    assert clock.total_rounds == 3
    clock.start_round()
    now[0] += 1.0
    assert not clock.round_ends(step=500) and clock.schedule_step(500, round_index=1) == 12
    now[0] += 3.0
    assert clock.round_ends(step=3)  # however few steps a slow worker ran
    assert clock.running(10_000, 2) and not clock.running(3, 3)
    assert clock.schedule_step(0, round_index=2) == 29  # never past the schedule's end


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["outer.round_s=-1"], "outer.round_s"),
        (["outer.round_s=2", "outer.sync_every=0"], "outer.round_s needs DiLoCo rounds"),
        (["outer.round_s=2", "outer.overlap=delayed"], "blocking rounds only"),
    ],
)
def test_time_budgets_that_cannot_work_are_one_line_errors(overrides, message):
    from diloco.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
