#!/usr/bin/env bash
# A compression sweep from one YAML: the same run with each codec, then one plot of validation
# loss against the bytes each worker sent.
#
#   bash examples/compression_sweep.sh                          # none fp16 int8 int4 topk
#   CODECS="none int8" bash examples/compression_sweep.sh inner.steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${DILOCO:-}" ] || { bash launch/setup.sh; DILOCO=.venv/bin/diloco; }
OUT=${OUT:-runs/example-compression-sweep}
runs=()
for codec in ${CODECS:-none fp16 int8 int4 topk}; do
  echo "== compression.name=$codec"
  $DILOCO local examples/compression_sweep.yaml --workers 4 --run-dir "$OUT/$codec" compression.name="$codec" "$@"
  runs+=("$OUT/$codec")
done
$DILOCO plot "${runs[@]}" --out "$OUT/sweep.png"
