"""The flake finder's table (``launch/stress.sh``): each test's pass rate over the JUnit reports
given, and its slowest time, the least reliable first.

    python launch/stress_table.py runs/stress-1/pass-*.xml
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def outcomes(paths: list[str]) -> dict[str, list[tuple[bool, float]]]:
    """(passed, seconds) of every run of each test, by its pytest id; skipped runs are left out."""
    runs: dict[str, list[tuple[bool, float]]] = defaultdict(list)
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            if case.find("skipped") is not None:
                continue
            failed = case.find("failure") is not None or case.find("error") is not None
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            runs[name].append((not failed, float(case.get("time", 0.0))))
    return runs


def table(runs: dict[str, list[tuple[bool, float]]]) -> str:
    rows = sorted(runs.items(), key=lambda item: (sum(p for p, _ in item[1]) / len(item[1]), item[0]))
    lines = ["| test | passed | slowest |", "| --- | --- | --- |"]
    for name, results in rows:
        passed = sum(p for p, _ in results)
        lines.append(f"| `{name}` | {passed} of {len(results)} | {max(s for _, s in results):.1f} s |")
    flaky = sum(1 for results in runs.values() if not all(p for p, _ in results))
    lines.append("")
    lines.append(f"{len(runs)} tests, {flaky} not passing every time")
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    if not paths:
        print("usage: python launch/stress_table.py PASS.xml [PASS.xml ...]", file=sys.stderr)
        return 2
    print(table(outcomes(paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
