"""``diloco bench nat``'s arms and what it reads from the helpers' logs (the runs: test_nat.py)."""

from __future__ import annotations

from diloco.bench.nat import _helper_mb_per_round, arms_of, format_table


def test_every_pair_of_nat_and_helper_counts_is_an_arm_but_all_behind_nat_without_a_helper():
    assert arms_of([0, 2, 3], [0, 1], workers=3) == [(0, 0), (0, 1), (2, 0), (2, 1), (3, 1)]
    assert arms_of([3], [0], workers=3) == []


def test_the_helpers_bytes_are_summed_over_helpers_round_by_round(tmp_path):
    line = "round {}: reduced parts for 3 workers ({} MB in, {} MB out, 0.1 s)\n"
    (tmp_path / "helper-0.log").write_text("up\n" + line.format(1, 1.0, 1.0) + line.format(2, 2.0, 2.0))
    (tmp_path / "helper-1.log").write_text(line.format(1, 0.5, 0.5) + line.format(2, 0.5, 0.5))
    assert _helper_mb_per_round(tmp_path, 2) == (3.0 + 5.0) / 2
    assert _helper_mb_per_round(tmp_path, 0) is None
    row = {"behind_nat": 3, "helpers": 2, "helper_mb_per_round": 4.0, "median_round_s": 2.0, "rounds": 5,
           "rounds_averaged_by_all": 5, "compute_utilization": 0.5, "params_agree": True}  # fmt: skip
    base = {**row, "behind_nat": 0, "helpers": 0, "helper_mb_per_round": None, "median_round_s": 1.0}
    assert "| 3 of 3 | 2 | 2.00 s | 2.00 | 5 of 5 | 0.500 | 4.00 | yes |" in format_table([base, row], 20, 3)
