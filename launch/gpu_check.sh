#!/usr/bin/env bash
# One GPU: the framework measured and trained end to end on it, in steps that each write their
# figures under $OUT_DIR as soon as they end (a run stopped part-way keeps what it measured):
#
#   pytest   the CUDA unit tests (tests/unit/test_gpu_path.py: fused AdamW, pinned copies, compiled
#            state_dict keys, the global copy on the GPU)                       -> pytest.log
#   bench    `diloco bench gpu`: the 111M GPT's inner step, eager and compiled, each lever on MFU
#            an arm of its own, and a round's local work (~2 min)             -> gpu.json, bench.log
#   run      `diloco bench gpu-train --parts run`: 4 workers over hivemind sharing the GPU, one
#            killed and restarted mid-run (limit 5 min)                  -> gpu-train.json, run.log
#   quality  `diloco bench gpu-train --parts alone,diloco`: one worker at the global batch (the
#            data-parallel baseline) and 4 simulated DiLoCo workers at equal tokens, on the real
#            corpus (~3.5 min)                                        -> gpu-train.json, quality.log
#
# plus gpu-train-runs.tgz (the runs' records, configs and logs, without checkpoints).
#
#   bash launch/gpu_check.sh                          # set up ./.venv, then every step
#   bash launch/gpu_check.sh --smoke                  # tiny sizes on the CPU: rehearses every step
#   SETUP=0 PYTHON=python3 STEPS="pytest bench run" bash launch/gpu_check.sh   # a machine with the
#   SETUP=0 PYTHON=python3 STEPS=quality bash launch/gpu_check.sh              # packages, in two sittings
#
# Knobs (environment variables):
#   SETUP=1              run launch/setup.sh first (0: use $PYTHON as it is)
#   PYTHON=.venv/bin/python   the interpreter
#   OUT_DIR=runs/gpu-check    where the figures and logs go (a handful of small files)
#   RUNS_DIR=runs/gpu-check-runs  gpu-train's run directories (checkpoints: tens of GB)
#   DATA=runs/pycorpus/cache  the token cache of `diloco corpus` (gpu-train's corpus); a
#                        tokens.bin.xz beside tokens.json is unpacked first
#   STEPS="pytest bench run quality"   which steps to run
#   PYTEST_S=90 BENCH_S=150 RUN_S=300 QUALITY_S=300   each step's limit in seconds
set -uo pipefail
cd "$(dirname "$0")/.."
SETUP=${SETUP:-1}
PYTHON=${PYTHON:-.venv/bin/python}
OUT_DIR=${OUT_DIR:-runs/gpu-check}
RUNS_DIR=${RUNS_DIR:-runs/gpu-check-runs}
DATA=${DATA:-runs/pycorpus/cache}
STEPS=${STEPS:-pytest bench run quality}
PYTEST_S=${PYTEST_S:-90}
BENCH_S=${BENCH_S:-150}
RUN_S=${RUN_S:-300}
QUALITY_S=${QUALITY_S:-300}
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
      --levers compiled,compiled-batch64,eager
  fi
fi
unpack() {  # the token cache travels packed: tokens.bin.xz beside tokens.json
  if [ -f "$DATA/tokens.bin.xz" ] && [ ! -f "$DATA/tokens.bin" ]; then
    "$PYTHON" -c 'import lzma, os, shutil, sys
with lzma.open(sys.argv[1]) as packed, open(sys.argv[2] + ".partial", "wb") as out:
    shutil.copyfileobj(packed, out, 1 << 24)
os.replace(sys.argv[2] + ".partial", sys.argv[2])' "$DATA/tokens.bin.xz" "$DATA/tokens.bin"
  fi
}

train() {  # train NAME LIMIT_S PARTS: `diloco bench gpu-train` for those parts, each its share of the limit
  local name=$1 limit=$2 parts=$3
  local each=$(((limit - 30) / $(echo "$parts" | tr ',' '\n' | wc -l)))
  if [ "$SMOKE" = 1 ]; then
    step "$name" "$limit" "$PYTHON" -m diloco.cli bench gpu-train --smoke --parts "$parts" --out "$RUNS_DIR"
  else
    unpack
    step "$name" "$limit" "$PYTHON" -m diloco.cli bench gpu-train --parts "$parts" --out "$RUNS_DIR" \
      --timeout-s "$each" "data.token_cache=$DATA"
  fi
  cp "$RUNS_DIR/gpu-train.json" "$OUT_DIR/" 2>/dev/null
  # the runs' records, configs and logs, without their checkpoints
  tar -czf "$OUT_DIR/gpu-train-runs.tgz" -C "$RUNS_DIR" --exclude='checkpoints' . 2>/dev/null
}

if has run; then
  train run "$RUN_S" run
fi
if has quality; then
  train quality "$QUALITY_S" alone,diloco
fi
echo "== gpu_check: done in $((SECONDS - started)) s; failed: ${failed[*]:-none}"
[ ${#failed[@]} = 0 ]
