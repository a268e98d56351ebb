#!/usr/bin/env bash
# One site of a multi-site run: NPROC local ranks (e.g. the GPUs of this node) that train as ONE
# worker of the run, data-parallel inside the site (gradients averaged every inner step over the
# site's fast links). SHARDING=ddp: every rank holds the model and rank 0 syncs with the other
# sites over hivemind; SHARDING=fsdp: the model is sharded over the ranks (FSDP2) and every rank
# syncs its own shard with the same rank of the other sites, which must have NPROC ranks too
# (diloco/comm/sites.py). Environment knobs with defaults; extra KEY=VALUE overrides pass through.
#
#   SITE=0 SITES=2 NPROC=8 PEERS=/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW... bash launch/site.sh
#   SITE=1 SITES=2 NPROC=8 PEERS=... CONFIG=configs/llama-150m.yaml bash launch/site.sh worker.device=cuda
#   SITE=0 SITES=2 NPROC=8 PEERS=... SHARDING=fsdp bash launch/site.sh worker.device=cuda
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
SITE=${SITE:-0}
SITES=${SITES:-2}
NPROC=${NPROC:-2}
SHARDING=${SHARDING:-ddp}
CONFIG=${CONFIG:-configs/tiny.yaml}
RUN_DIR=${RUN_DIR:-runs/site-$SITE}
THREADS=${THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
PEERS=${PEERS:?set PEERS to the multiaddr of the run bootstrap peer (diloco bootstrap prints it)}
exec .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" -m diloco.cli train "$CONFIG" \
  worker.site=true worker.site_sharding="$SHARDING" worker.index="$SITE" worker.count="$SITES" run.dir="$RUN_DIR" worker.threads="$THREADS" \
  comm.hivemind.host=0.0.0.0 comm.hivemind.initial_peers="['$PEERS']" "$@"
