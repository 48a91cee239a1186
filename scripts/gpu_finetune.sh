#!/usr/bin/env bash
# DAR by fine-tuning on the GPU host (issue 10): train a llama-120m base on wiki-gutenberg (T = 1024),
# then fine-tune it on chat data with DAR at d_down = d/4, d/8, d/16 and the d_down = d baseline
# (experiments/finetune-llama-120m-dar.yaml), collecting every run's eval.json (base vs fine-tuned
# held-out loss on assistant tokens) and metrics.jsonl. CHAT overrides the data (e.g.
# CHAT='{alpaca: .gpu/data/alpaca_200.jsonl}' when no Tülu file was carried).
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
A=.gpu/attnlab
T0=$(date +%s)
$A train experiments/tiny-synthetic.yaml --set model.flavor=llama-120m --set 'attention={kind: vanilla}' \
  --set data.tokenizer=.gpu/data/gpt-neox-20b.json --set 'data.train={path: .gpu/data/train-00.jsonl.zst}' \
  --set 'data.eval={}' --set data.seq_len=1024 --set data.cache=/tmp/cache --set train.batch_size=32 \
  --set train.steps=${BASE_STEPS:-1000} --set train.lr=6e-4 --set train.min_lr=6e-5 --set train.warmup=0.02 \
  --set checkpoint.every=0 --set checkpoint.keep=1 --quiet --out /tmp/llama-120m-base 2>&1 | tail -2 | tee -a "$OUT/finetune.log"
echo "base wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/finetune.log"
for d in ${D_DOWNS:-768 192 96 48}; do
  T1=$(date +%s)
  extra=(); [ -n "${CHAT:-}" ] && extra=(--set "data.train=$CHAT")
  $A finetune experiments/finetune-llama-120m-dar.yaml --set attention.d_down=$d --set output=/tmp/ft-llama-120m/d$d \
    "${extra[@]}" --quiet 2>&1 | tail -30 | tee -a "$OUT/finetune.log"
  echo "d_down $d wall $(( $(date +%s) - T1 )) s" | tee -a "$OUT/finetune.log"
  for f in eval.json metrics.jsonl config.yaml; do cp /tmp/ft-llama-120m/d$d/$f "$OUT/d$d-$f" 2>/dev/null; done
done
