#!/usr/bin/env bash
# The flake finder: run tests N times, one test at a time, beside one CPU-bound process per core
# (a busy machine, as CI's can be), then print each test's pass rate and its slowest time. A test
# that is not N of N is a bug: in the product when it is at fault, in the test when it waits on a
# time instead of an event. Each pass's JUnit report, pytest output and test folders (the runs'
# worker logs) stay in the output folder.
#
#   bash launch/stress.sh 10                                   # the integration tests, 10 times
#   bash launch/stress.sh 5 tests/integration/test_local_run.py
#   BUSY=0 bash launch/stress.sh 3                             # on an idle machine
#   OUT=runs/stress-1 bash launch/stress.sh 10                 # where reports go (default runs/stress-DATE)
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
passes=${1:-10}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(tests/integration)
out=${OUT:-runs/stress-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
busy=${BUSY:-$(nproc)}

pids=()
cleanup() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT INT TERM
for _ in $(seq 1 "$busy"); do
  .venv/bin/python -c 'while True: pass' &
  pids+=($!)
done

echo "stress: ${targets[*]}, $passes passes beside $busy busy processes; reports in $out"
for pass in $(seq 1 "$passes"); do
  started=$(date +%s)
  .venv/bin/python -m pytest -q -p no:cacheprovider --junitxml="$out/pass-$pass.xml" \
    --basetemp="$out/tmp-$pass" "${targets[@]}" \
    > "$out/pass-$pass.log" 2>&1 || true
  echo "stress: pass $pass of $passes: $(tail -n 1 "$out/pass-$pass.log") ($(( $(date +%s) - started )) s)"
done
cleanup
pids=()
.venv/bin/python launch/stress_table.py "$out"/pass-*.xml | tee "$out/table.md"
