#!/usr/bin/env bash
# The quick start: set up, then train 4 DiLoCo workers on this machine over hivemind (loopback)
# on the embedded corpus, and print the summary. A few minutes on 2 CPU cores.
#
#   bash launch/demo.sh                         # 4 workers, configs/tiny.yaml
#   WORKERS=2 bash launch/demo.sh inner.steps=100   # extra KEY=VALUE overrides pass through
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
WORKERS=${WORKERS:-4}
CONFIG=${CONFIG:-configs/tiny.yaml}
RUN_DIR=${RUN_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}
exec .venv/bin/diloco local "$CONFIG" --workers "$WORKERS" --run-dir "$RUN_DIR" "$@"
