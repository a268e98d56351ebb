"""``diloco plot``: every panel (tokens, wall time, bytes) has a point per round of the records a
worker writes. Skipped without the optional matplotlib."""

from __future__ import annotations

import pytest

from diloco.tools.plot import draw_curves, load_curve, pyplot
from tests.records import write_session

pytest.importorskip("matplotlib")


def test_each_panel_of_the_plot_has_a_point_per_round(tmp_path):
    for worker in (0, 1):
        write_session(tmp_path, worker, rounds=3)
    curve = load_curve(tmp_path)
    figure = draw_curves([curve])
    for panel in figure.axes:
        (line,) = panel.get_lines()
        xs = list(line.get_xdata())
        assert len(xs) == 3 and min(xs) > 0 and xs == sorted(xs), (panel.get_xlabel(), xs)
    pyplot().close(figure)
    assert curve["seconds"][0] >= 5.0  # the worker's clock, not a placeholder
