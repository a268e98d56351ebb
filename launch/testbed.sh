#!/usr/bin/env bash
# Run M workers on this machine, each in its own network namespace behind a link shaped with
# tc tbf (root only): the testbed for slow-link behaviour. Everything it creates is torn down on
# exit, error, Ctrl-C or SIGTERM (see diloco/tools/testbed.py). Extra KEY=VALUE overrides pass through.
#
#   sudo WORKERS=4 RATE=20 bash launch/testbed.sh                # 4 workers on 20 Mbit/s links
#   sudo UP=5 DOWN=50 bash launch/testbed.sh outer.sync_every=100 # asymmetric links
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
  echo "launch/testbed.sh: the network testbed needs root (network namespaces, veth pairs and tc)" >&2
  exit 2
fi
bash launch/setup.sh
WORKERS=${WORKERS:-4}
RATE=${RATE:-20}
CONFIG=${CONFIG:-configs/tiny.yaml}
RUN_DIR=${RUN_DIR:-runs/testbed-$(date +%Y%m%d-%H%M%S)}
exec .venv/bin/diloco testbed "$CONFIG" --workers "$WORKERS" --up "${UP:-$RATE}" --down "${DOWN:-$RATE}" \
  --run-dir "$RUN_DIR" "$@"
