"""The watchdog: a phase that outlasts its bound is reported, with the thread stacks; one that does
not is left alone; every change reaches the listener (the roster record ``diloco status`` reads)."""

from __future__ import annotations

import threading

import pytest

from diloco.comm.bounds import phase_bounds, round_limit_s
from diloco.worker.watchdog import PHASES, Watchdog


@pytest.mark.timeout(30)
def test_a_phase_past_its_bound_is_reported_with_the_thread_stacks(tmp_path, caplog):
    stalled = threading.Event()
    seen: list[str] = []
    stacks = tmp_path / "stacks-worker-0.txt"
    watchdog = Watchdog({"averaging": 0.2}, stacks_path=stacks, on_phase=lambda name, since: seen.append(name),
                        poll_s=0.05)  # fmt: skip
    default_warning = watchdog._on_stall
    watchdog._on_stall = lambda phase, lasted: (default_warning(phase, lasted), stalled.set())
    try:
        watchdog.enter("training")  # no bound: never reported
        with watchdog.phase("averaging"):
            assert stalled.wait(timeout=20)
            assert watchdog.current()[0] == "averaging"
    finally:
        watchdog.stop()
    assert seen == ["training", "averaging", "training"]
    assert "still averaging after 0 s (its bound: 0 s); thread stacks in" in caplog.text
    assert "test_a_phase_past_its_bound_is_reported" in stacks.read_text()  # this test's own frame


@pytest.mark.timeout(30)
def test_a_phase_within_its_bound_is_not_reported():
    reported = []
    watchdog = Watchdog({"training": 60.0}, on_stall=lambda *args: reported.append(args), poll_s=0.01)
    ticks = threading.Event()
    try:
        for _ in range(20):
            watchdog.enter("training")  # a new inner step restarts the phase's clock
            ticks.wait(0.005)
    finally:
        watchdog.stop()
    assert reported == []


def test_every_phase_has_a_bound_and_a_round_outlasts_its_own_limit():
    bounds = phase_bounds(deadline_s=60.0, matchmaking_s=15.0)
    assert set(bounds) == set(PHASES)
    assert bounds["averaging"] > round_limit_s(60.0) and bounds["training"] == 60.0


def test_the_watchdog_adds_up_the_seconds_of_each_phase_until_asked():
    clock = [0.0]
    watchdog = Watchdog({}, poll_s=60.0)
    try:
        import diloco.worker.watchdog as module

        real = module.time.monotonic
        module.time.monotonic = lambda: clock[0]
        try:
            watchdog.enter("training")
            clock[0] = 2.0
            watchdog.enter("averaging")
            clock[0] = 5.0
            watchdog.enter("training")
            clock[0] = 6.0
            spent = watchdog.take_spent()
            clock[0] = 6.5
            assert watchdog.current() == ("training", 1.5)  # asking does not restart the phase's clock
            later = watchdog.take_spent()
        finally:
            module.time.monotonic = real
    finally:
        watchdog.stop()
    assert spent["training"] == 3.0 and spent["averaging"] == 3.0
    assert later == {"training": 0.5}
