#!/usr/bin/env bash
# Set up, then run the lint and the whole test suite (unit + integration with real hivemind
# peers on loopback). About 3 minutes on 2 cores. Extra arguments go to pytest.
#
#   bash launch/test.sh                 # everything
#   bash launch/test.sh tests/unit -x   # a part
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
exec .venv/bin/python -m pytest -q "$@"
