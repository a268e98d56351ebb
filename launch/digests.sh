#!/usr/bin/env bash
# The params' digest at the end of one short simulated run per way of training (blocking, delayed,
# streaming, data-parallel, top-k, int4, SparseLoCo), one line each with every worker's
# digest and final val loss: a change that should not alter training must leave every line as it
# was. About two minutes on 2 cores.
#
#   bash launch/digests.sh > before.txt; (change); bash launch/digests.sh | diff before.txt -
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(configs/tiny.yaml --workers 2 comm.backend=simulator inner.steps=60 outer.sync_every=20
  data.max_bytes=400000 logging.eval_batches=2 checkpoint.every_rounds=0)
arms=(
  "blocking|"
  "delayed|outer.overlap=delayed"
  "delayed-eager|outer.overlap=delayed outer.eager=true"
  "streaming|outer.overlap=streaming outer.fragments=2"
  "data-parallel|outer.sync_every=0 inner.steps=20"
  "topk|compression.name=topk"
  "int4|compression.name=int4"
  "sparseloco|outer.optimizer=sparseloco compression.name=topk"
)
# HIVEMIND=1: also over real hivemind peers on loopback: 4 workers, and adaptive codecs (which need
# hivemind). Their sums run in arrival order: compare these over repeated runs, not once
if [ "${HIVEMIND:-0}" = 1 ]; then
  arms+=(
    "hivemind-4|--workers 4 comm.backend=hivemind"
    "hivemind-adaptive|comm.backend=hivemind compression.name=adaptive"
  )
fi
for arm in "${arms[@]}"; do
  name=${arm%%|*}
  read -r -a extra <<<"${arm#*|}"
  "$python" -m diloco.cli local "${common[@]}" --run-dir "$out/$name" "${extra[@]}" >"$out/$name.log" 2>&1 \
    || { echo "$name: failed"; tail -5 "$out/$name.log"; exit 1; }
  ends=$("$python" -c '
import json, pathlib, sys
records = [json.loads(line) for f in sorted(pathlib.Path(sys.argv[1]).glob("worker-*.jsonl")) for line in open(f)]
print("  ".join("%s %.4f" % (r["param_sha256"][:12], r["val_loss"]) for r in records if r["event"] == "end"))
' "$out/$name")
  echo "$name: $ends"
done
