#!/usr/bin/env bash
# DiLoCo against data-parallel training on a small budget: 4 workers syncing every 20 and every
# 50 inner steps against 4 workers averaging gradients every step, at equal tokens, on
# the text given by --data FILE (docs/benchmarks.md uses tinyshakespeare). All on the in-process
# simulator.
# Prints the table (final val loss, ratio to DDP, bytes) and writes quality.png.
#
#   bash examples/diloco_vs_ddp.sh                    # 500 inner steps, 1 seed: ~10 min on 2 cores
#   STEPS=2000 SEEDS=3 bash examples/diloco_vs_ddp.sh --data data/tinyshakespeare.txt
#                                                     # the reference budget of docs/benchmarks.md
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${DILOCO:-}" ] || { bash launch/setup.sh; DILOCO=.venv/bin/diloco; }
OUT=${OUT:-runs/example-diloco-vs-ddp}
$DILOCO bench quality --arms ddp,m4-h20,m4-h50 --steps "${STEPS:-500}" --seeds "${SEEDS:-1}" --out "$OUT" "$@"
echo "plot: $OUT/quality.png"
