#!/usr/bin/env bash
# Set up, then run the lint and the whole test suite: the unit tests two at a time, then the
# integration tests (real hivemind peers on loopback and in network namespaces) one at a time
# (docs/development.md has the times). The slowest tests are listed at the end. Extra arguments
# go to pytest, and run what they name in one pytest.
#
# TEST_JOBS=N runs N test processes (pytest-xdist; the tests that build network testbeds stay in
# one of them). Only for machines with cores to spare: each integration test starts 3-5 processes
# of its own: with TEST_JOBS=3 on 2 cores three timing-bound tests failed and the suite saved
# only 2.5 minutes; with TEST_JOBS=2 the suite took 14 minutes and a NAT scenario failed.
#
#   bash launch/test.sh                        # everything
#   bash launch/test.sh tests/unit -x          # a part
#   TEST_JOBS=8 bash launch/test.sh            # on a machine with 16 cores
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
# the NAT tests build home routers in network namespaces with iptables: as root, install it if missing
if [ "$(id -u)" = 0 ] && ! command -v iptables >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "test: installing iptables for the NAT tests"
  apt-get install -y -q iptables >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iptables >/dev/null 2>&1; } \
    || echo "test: could not install iptables; the NAT tests will be skipped"
fi
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
.venv/bin/lint-imports --no-cache  # the import layers of pyproject.toml: a lower layer never imports a higher one
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -n "${TEST_JOBS:-0}" --dist loadgroup --durations=25 "$@"
fi
# the unit tests are CPU work: two processes on two cores (UNIT_JOBS); the integration scenarios
# start processes of their own and wait on them, one at a time (TEST_JOBS)
unit=0
.venv/bin/python -m pytest -q -n "${UNIT_JOBS:-2}" --durations=10 tests/unit || unit=$?
integration=0
.venv/bin/python -m pytest -q -n "${TEST_JOBS:-0}" --dist loadgroup --durations=25 tests/integration || integration=$?
[ "$unit" = 0 ] || exit "$unit"  # both ran: a failure of either fails the suite
exit "$integration"
