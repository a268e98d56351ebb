#!/usr/bin/env bash
# Set up, then run the lint and the whole test suite (unit + integration with real hivemind
# peers on loopback). About 15 minutes on 2 cores; the 25 slowest tests are listed at the end.
# Extra arguments go to pytest.
#
#   bash launch/test.sh                 # everything
#   bash launch/test.sh tests/unit -x   # a part
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
exec .venv/bin/python -m pytest -q --durations=25 "$@"
