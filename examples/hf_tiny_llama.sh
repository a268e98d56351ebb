#!/usr/bin/env bash
# A Hugging Face tiny Llama trained with DiLoCo on tinyshakespeare, tokenized by a BPE tokenizer
# trained here first (everything local: nothing is downloaded). Needs the hf extra
# (pip install 'diloco[hf]'; launch/setup.sh installs it). 2 simulated workers in one process.
#
#   bash examples/hf_tiny_llama.sh                    # a few minutes on 2 cores
#   bash examples/hf_tiny_llama.sh inner.steps=50     # KEY=VALUE overrides pass through
#   TEXT=other.txt bash examples/hf_tiny_llama.sh     # another text file (a path from the repository root)
#
# The text defaults to data/tinyshakespeare.txt, which the repository ships.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${DILOCO:-}" ] || { bash launch/setup.sh; DILOCO=.venv/bin/diloco; }
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/example-hf-tiny-llama}
TEXT=${TEXT:-data/tinyshakespeare.txt}
[ -f "$TEXT" ] || { echo "no $TEXT: download it (docs/benchmarks.md) or set TEXT=some/text/file.txt" >&2; exit 2; }
mkdir -p "$OUT"

echo "== a byte-level BPE tokenizer of ${VOCAB:-512} ids, trained on $TEXT"
"$PYTHON" - "$TEXT" "$OUT/tokenizer.json" "${VOCAB:-512}" <<'PY'
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

text, out, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tokenizer.train([text], trainer)
tokenizer.save(out)
print(f"   {out}: {tokenizer.get_vocab_size()} ids")
PY

echo "== llama-tiny, 2 workers, H=20"
$DILOCO local --workers 2 --run-dir "$OUT/run" comm.backend=simulator model.kind=hf model.hf_config=llama-tiny \
  data.path="$TEXT" data.tokenizer="$OUT/tokenizer.json" inner.steps=200 outer.sync_every=20 "$@"
