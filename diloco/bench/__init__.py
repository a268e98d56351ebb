"""Benchmarks anyone can rerun: ``diloco bench NAME``. Each prints ratios measured side by side
in one run (medians of repeats), since these machines are shared and noisy."""
