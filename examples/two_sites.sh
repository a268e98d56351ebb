#!/usr/bin/env bash
# Two "sites" training one run, on this machine, with the very commands two volunteers on two
# machines would type (each site its own run directory, as on separate disks):
#
#   site A: diloco bootstrap                      a long-lived DHT peer others join through
#   site A: diloco train CONFIG worker.count=2    the first worker, told the bootstrap's address
#   site B: diloco status --peers ADDR            who is in the run
#   site B: diloco join CONFIG --peers ADDR       takes a free slot and the run's current state
#
#   bash examples/two_sites.sh                    # configs/tiny.yaml, a few minutes on 2 cores
#   bash examples/two_sites.sh inner.steps=100    # KEY=VALUE overrides go to both sites
#
# On two real machines: run `diloco bootstrap --host 0.0.0.0 --port 31337` on a host whose TCP
# port 31337 is reachable, and give the address it prints (with the host's public IP) to site B.
# The run key keeps strangers out: both sites need the same $DILOCO_RUN_KEY.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${DILOCO:-}" ] || { bash launch/setup.sh; DILOCO=.venv/bin/diloco; }
CONFIG=${CONFIG:-configs/tiny.yaml}
RUN_DIR=${RUN_DIR:-runs/two-sites-$(date +%Y%m%d-%H%M%S)}
export DILOCO_RUN_KEY=${DILOCO_RUN_KEY:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
mkdir -p "$RUN_DIR"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

echo "== site A: bootstrap peer"
$DILOCO bootstrap --host 127.0.0.1 --port 0 > "$RUN_DIR/bootstrap.log" 2>&1 &
pids+=($!)
for _ in $(seq 120); do grep -q "initial_peers=" "$RUN_DIR/bootstrap.log" && break; sleep 0.5; done
PEER=$(grep -o "/ip4/[^']*" "$RUN_DIR/bootstrap.log" | head -1)
[ -n "$PEER" ] || { echo "the bootstrap peer did not start; see $RUN_DIR/bootstrap.log" >&2; exit 1; }
echo "   $PEER"

echo "== site A: worker 0 (output in $RUN_DIR/site-a.log)"
$DILOCO train "$CONFIG" worker.count=2 run.dir="$RUN_DIR/site-a" comm.hivemind.initial_peers="['$PEER']" "$@" \
  > "$RUN_DIR/site-a.log" 2>&1 &
pids+=($!)

echo "== site B: who is in the run?"
$DILOCO status "$CONFIG" --peers "$PEER" --timeout 60 "$@"

echo "== site B: join it"
$DILOCO join "$CONFIG" --peers "$PEER" worker.count=2 run.dir="$RUN_DIR/site-b" "$@"

wait "${pids[1]}"
echo "== both sites finished; their last rounds (the params must be the same):"
for site in site-a site-b; do
  last=$(grep '"event": "round"' "$RUN_DIR/$site/"worker-*.jsonl | tail -1)
  echo "   $site: $(echo "$last" | grep -o '"round": [0-9]*\|"val_loss": [0-9.]*\|"param_sha256": "[0-9a-f]\{16\}' | tr '\n' ' ')"
done
