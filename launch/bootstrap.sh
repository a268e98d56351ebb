#!/usr/bin/env bash
# Start a long-lived bootstrap peer (DHT only, no training) that workers on other machines join
# through. Prints the address to give them. Ctrl-C stops it.
#
#   HOST=0.0.0.0 PORT=31337 bash launch/bootstrap.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/diloco bootstrap --host "${HOST:-0.0.0.0}" --port "${PORT:-31337}"
