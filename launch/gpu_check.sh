#!/usr/bin/env bash
# One GPU, under 5 minutes: inner-step tokens/s and MFU of a ~110M GPT in bf16, the outer sync's
# local work as a share of a round of H=100, peak GPU memory (`diloco bench gpu`, diloco/bench/gpu.py).
# Prints the figures, then one JSON line, also written to $OUT_DIR/gpu.json.
#
#   bash launch/gpu_check.sh                          # set up ./.venv, then measure
#   bash launch/gpu_check.sh --batch 32 --no-compile  # extra args pass through to `diloco bench gpu`
#   SETUP=0 PYTHON=python3 bash launch/gpu_check.sh   # a machine with torch already and no network
#
# Knobs (environment variables):
#   SETUP=1              run launch/setup.sh first (0: use $PYTHON as it is; it needs only torch)
#   PYTHON=.venv/bin/python   the interpreter that runs the benchmark
#   OUT_DIR=runs/bench-gpu    where gpu.json goes
#   TIMEOUT_S=290        stop the benchmark after this many seconds (0: no limit)
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP=${SETUP:-1}
PYTHON=${PYTHON:-.venv/bin/python}
OUT_DIR=${OUT_DIR:-runs/bench-gpu}
TIMEOUT_S=${TIMEOUT_S:-290}
if [ "$SETUP" = 1 ]; then
  bash launch/setup.sh
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
limit=()
if [ "$TIMEOUT_S" != 0 ]; then
  limit=(timeout "$TIMEOUT_S")
fi
exec "${limit[@]}" "$PYTHON" -m diloco.bench.gpu --out "$OUT_DIR" "$@"
