#!/usr/bin/env bash
# Foundation check on the GPU host: Pythia-70M vanilla / DAR (d_down 128, w 128) / uniform at
# T = 2048 in bf16 on the wiki-gutenberg corpus (one epoch, 336 steps × 32 × 2048 tokens), rolling
# perplexity on WikiText test. Needs .gpu/attnlab and .gpu/data/ (see BENCHMARKS.md). Run
# directories stay on the host; their config/metrics/eval files come back in $OUT/runs.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
STEPS=${STEPS:-336}
RUNS=/tmp/runs; mkdir -p $RUNS
common=(--set data.tokenizer=.gpu/data/gpt-neox-20b.json --set 'data.train.path=.gpu/data/train-*.jsonl.zst'
        --set data.eval.wikitext.path=.gpu/data/test.raw.txt --set data.cache=/tmp/cache --set train.steps=$STEPS
        --set train.log_every=8 --quiet)
for kind in vanilla dar uniform; do
  case $kind in
    vanilla) spec=experiments/pythia-70m-vanilla.yaml; extra=() ;;
    dar) spec=experiments/pythia-70m-dar.yaml; extra=() ;;
    uniform) spec=experiments/pythia-70m-dar.yaml; extra=(--set 'attention={kind: uniform, d_down: 128}') ;;
  esac
  echo "+ train $kind" | tee -a "$OUT/train.log"
  /usr/bin/time -v .gpu/attnlab train $spec "${common[@]}" "${extra[@]}" --out $RUNS/$kind 2>&1 \
    | grep -E "trained|wikitext|error|caused|Maximum resident|Elapsed" | tee -a "$OUT/train.log"
  .gpu/attnlab bench $spec --json --steps 10 --warmup 3 "${extra[@]}" 2>&1 | grep '^{' >> "$OUT/train_bench.jsonl"
done
tar czf "$OUT/runs.tgz" -C $RUNS $(cd $RUNS && ls -d */config.yaml */metrics.jsonl */eval.json 2>/dev/null)
