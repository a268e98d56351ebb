#!/usr/bin/env bash
# One GPU, under 10 minutes: the framework measured and trained end to end on it. Every step writes
# its figures under $OUT_DIR as soon as it ends, so a run stopped part-way keeps what it measured.
#
#   1. the CUDA unit tests (tests/unit/test_gpu_path.py: fused AdamW, pinned copies, compiled
#      state_dict keys, the global copy on the GPU)                          -> $OUT_DIR/pytest.log
#   2. `diloco bench gpu`: the inner step's tokens/s and MFU of the 111M GPT, eager and compiled,
#      with each lever on MFU as an arm (batch 64, cuDNN attention), and a round's local work
#                                                                           -> $OUT_DIR/gpu.json
#   3. `diloco bench gpu-train`: 4 workers over hivemind sharing the GPU (one killed and restarted
#      mid-run), one worker alone at the global batch (the data-parallel baseline), 4 simulated
#      DiLoCo workers at equal tokens, all on the real corpus                 -> $OUT_DIR/gpu-train.json
#
#   bash launch/gpu_check.sh                          # set up ./.venv, then measure
#   bash launch/gpu_check.sh --smoke                  # tiny sizes on the CPU: rehearses every step
#   SETUP=0 PYTHON=python3 bash launch/gpu_check.sh   # a machine with the packages and no network
#
# Knobs (environment variables):
#   SETUP=1              run launch/setup.sh first (0: use $PYTHON as it is)
#   PYTHON=.venv/bin/python   the interpreter
#   OUT_DIR=runs/gpu-check    where the figures and logs go (a handful of small files)
#   RUNS_DIR=runs/gpu-check-runs  gpu-train's run directories (checkpoints: tens of GB)
#   DATA=runs/pycorpus/cache  the token cache of `diloco corpus` (gpu-train's corpus); a
#                        tokens.bin.xz beside tokens.json is unpacked first
#   STEPS="pytest bench train"  which steps to run
#   PYTEST_S=45 BENCH_S=150 TRAIN_S=370   each step's limit in seconds
set -uo pipefail
cd "$(dirname "$0")/.."
SETUP=${SETUP:-1}
PYTHON=${PYTHON:-.venv/bin/python}
OUT_DIR=${OUT_DIR:-runs/gpu-check}
RUNS_DIR=${RUNS_DIR:-runs/gpu-check-runs}
DATA=${DATA:-runs/pycorpus/cache}
STEPS=${STEPS:-pytest bench train}
BENCH_S=${BENCH_S:-150}
TRAIN_S=${TRAIN_S:-370}
PYTEST_S=${PYTEST_S:-45}
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then
  SMOKE=1
fi
if [ "$SETUP" = 1 ]; then
  bash launch/setup.sh || exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
started=$SECONDS
failed=()

step() {  # step NAME LIMIT_S COMMAND...: run it under its limit, its output into the terminal and a log
  local name=$1 limit=$2
  shift 2
  echo "== gpu_check: $name (limit ${limit} s, at $((SECONDS - started)) s)"
  timeout --kill-after=20 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local code=${PIPESTATUS[0]}
  if [ "$code" != 0 ]; then
    failed+=("$name:$code")
  fi
  echo "== gpu_check: $name exit $code at $((SECONDS - started)) s"
}

has() { [[ " $STEPS " == *" $1 "* ]]; }

if has pytest && [ "$SMOKE" = 0 ]; then
  step pytest "$PYTEST_S" "$PYTHON" -m pytest -q -p no:cacheprovider tests/unit/test_gpu_path.py
fi
if has bench; then
  if [ "$SMOKE" = 1 ]; then
    step bench "$BENCH_S" "$PYTHON" -m diloco.bench.gpu --smoke --out "$OUT_DIR" --levers eager
  else
    step bench "$BENCH_S" "$PYTHON" -m diloco.bench.gpu --out "$OUT_DIR" \
      --levers compiled,compiled-batch64,compiled-batch64-cudnn-attention,eager
  fi
fi
if has train; then
  if [ "$SMOKE" = 1 ]; then
    step train "$TRAIN_S" "$PYTHON" -m diloco.cli bench gpu-train --smoke --out "$RUNS_DIR"
  else
    if [ -f "$DATA/tokens.bin.xz" ] && [ ! -f "$DATA/tokens.bin" ]; then
      xz -d -k -T0 "$DATA/tokens.bin.xz" 2>/dev/null || "$PYTHON" -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as packed, open(sys.argv[2], "wb") as out:
    shutil.copyfileobj(packed, out, 1 << 24)' "$DATA/tokens.bin.xz" "$DATA/tokens.bin"
    fi
    step train "$TRAIN_S" "$PYTHON" -m diloco.cli bench gpu-train --out "$RUNS_DIR" \
      --timeout-s 160 "data.token_cache=$DATA"
  fi
  cp "$RUNS_DIR/gpu-train.json" "$OUT_DIR/" 2>/dev/null
  # the runs' records, configs and logs, without their checkpoints
  tar -czf "$OUT_DIR/gpu-train-runs.tgz" -C "$RUNS_DIR" --exclude='checkpoints' --exclude='*.pt' . 2>/dev/null
fi
echo "== gpu_check: done in $((SECONDS - started)) s; failed: ${failed[*]:-none}"
[ ${#failed[@]} = 0 ]
