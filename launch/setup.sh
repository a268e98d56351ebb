#!/usr/bin/env bash
# Set up diloco in ./.venv: Python 3.11+, PyTorch, hivemind and the rest. Idempotent: a second
# run with nothing changed takes a second.
#
#   bash launch/setup.sh            # what the quick start and the tests call
#
# Knobs (environment variables):
#   PYTHON=python3.11               the interpreter to build the venv from
#   VENV=.venv                      where the venv lives
#   TORCH_SPEC=...                  the torch requirement; default: torch==2.13.0 (a CPU build) when
#                                   no NVIDIA GPU is visible, else torch>=2.4 (pip's CUDA build)
#   PIP_EXTRA_ARGS=...              e.g. "--index-url https://download.pytorch.org/whl/cpu" on a
#                                   machine where PyPI's torch==2.13.0 would be a CUDA build
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=$(command -v python3.11 || command -v python3 || true)
fi
if [ -z "$PYTHON" ]; then
  echo "setup: no python3 found; install Python 3.11 or set PYTHON=/path/to/python" >&2
  exit 2
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: $PYTHON is $("$PYTHON" -V 2>&1); diloco needs Python 3.11 or newer (set PYTHON=...)" >&2
  exit 2
fi

if [ -z "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC="torch>=2.4"
  else
    TORCH_SPEC="torch==2.13.0"  # no GPU: a CPU build, not several GB of CUDA libraries
  fi
fi

stamp="$VENV/.diloco-setup"
want="$(cat pyproject.toml launch/setup.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c 'import diloco, hivemind, torch' 2>/dev/null; then
  exit 0
fi

echo "setup: creating $VENV with $("$PYTHON" -V 2>&1) and $TORCH_SPEC (a few minutes the first time)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" ${PIP_EXTRA_ARGS:-}; }
quiet() { { grep -vE "is ignored|BuildBackendWarning|^ +|^$" || true; }; }  # keep pip's own failures
pip install --upgrade pip 2>&1 | quiet
# torch first and pinned, so that no other package pulls in a newer (CUDA) build
pip install "$TORCH_SPEC" 2>&1 | quiet
# hf (transformers, datasets, accelerate): so that the tests of Hugging Face models, data and the Trainer callback run
pip install -e ".[dev,hf]" "$TORCH_SPEC" 2>&1 | quiet
"$VENV/bin/python" -c 'import diloco, hivemind, torch; print(f"setup: torch {torch.__version__}, hivemind {hivemind.__version__}")'
echo "$want" > "$stamp"
