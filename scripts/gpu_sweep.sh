#!/usr/bin/env bash
# Run a reduced-scale DAR sweep on the GPU host (e.g. sweeps/table1-reduced.yaml) with the data
# carried in .gpu/data, then pack every run's config.yaml, metrics.jsonl and eval.json into
# $OUT/runs.tgz for `attnlab report` on the CPU machine. Usage: scripts/gpu_sweep.sh SWEEP.yaml...
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
RUNS=/tmp/dar-reduced
for sweep in "$@"; do
  .gpu/attnlab sweep "$sweep" --out $RUNS --set data.tokenizer=.gpu/data/gpt-neox-20b.json \
    --set 'data.train.path=.gpu/data/train-*.jsonl.zst' --set data.eval.wikitext.path=.gpu/data/test.raw.txt \
    --set data.cache=/tmp/cache 2>&1 | grep -v "^sweep: \[" | tee -a "$OUT/sweep.log"
done
(cd $RUNS && tar czf "$OUT/runs.tgz" $(ls -d */config.yaml */metrics.jsonl */eval.json 2>/dev/null))
