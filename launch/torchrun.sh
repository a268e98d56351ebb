#!/usr/bin/env bash
# One site of workers on this machine over torch.distributed (gloo on CPU, NCCL on GPUs), for
# datacenter runs and the DDP baseline. Environment knobs with defaults; extra KEY=VALUE
# overrides pass through to every worker.
#
#   NPROC=4 CONFIG=configs/tiny.yaml bash launch/torchrun.sh
#   NPROC=4 bash launch/torchrun.sh outer.sync_every=0        # the data-parallel baseline
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
NPROC=${NPROC:-2}
CONFIG=${CONFIG:-configs/tiny.yaml}
RUN_DIR=${RUN_DIR:-runs/torchrun-$(date +%Y%m%d-%H%M%S)}
THREADS=${THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
exec .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" -m diloco.cli train "$CONFIG" \
  comm.backend=torchdist run.dir="$RUN_DIR" worker.threads="$THREADS" "$@"
