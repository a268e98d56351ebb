#!/usr/bin/env bash
# Set up, then run the lint and the whole test suite (unit + integration with real hivemind
# peers on loopback), TEST_JOBS test processes at a time (pytest-xdist; default 3: most
# integration tests wait on the network more than they compute; the tests that build network
# testbeds run one at a time, in one process). The 25 slowest tests are listed at the end.
# Extra arguments go to pytest.
#
#   bash launch/test.sh                        # everything
#   bash launch/test.sh tests/unit -x          # a part
#   TEST_JOBS=0 bash launch/test.sh -k crash   # in this process, one test at a time
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
exec .venv/bin/python -m pytest -q -n "${TEST_JOBS:-3}" --dist loadgroup --durations=25 "$@"
