#!/usr/bin/env bash
# STILL on the GPU host: train a llama-30m teacher on wiki-gutenberg shard 0 (4.4M tokens, T = 1024),
# then linearize it with STILL and with LoLCATs (stage 1 attention transfer, stage 2 LoRA), and report
# held-out perplexity of teacher vs students (valid split) with each stage's wall time.
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
A=.gpu/attnlab
T0=$(date +%s)
$A train experiments/tiny-synthetic.yaml --set model.flavor=llama-30m --set 'attention={kind: vanilla}' \
  --set data.tokenizer=.gpu/data/gpt-neox-20b.json --set 'data.train={path: .gpu/data/train-00.jsonl.zst}' \
  --set 'data.eval={}' --set data.seq_len=1024 --set data.cache=/tmp/cache --set train.batch_size=32 \
  --set train.steps=${TEACHER_STEPS:-400} --set train.lr=1e-3 --set train.min_lr=1e-4 --set train.warmup=0.02 \
  --set checkpoint.every=0 --set checkpoint.keep=1 --quiet --out /tmp/teacher 2>&1 | tail -2 | tee -a "$OUT/still.log"
echo "teacher wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/still.log"
for kind in still lolcats; do
  case $kind in
    still) att="{kind: still, chunk: 64, tokens_per_chunk: 4}" ;;
    lolcats) att="{kind: lolcats, window: 64}" ;;
  esac
  cat > /tmp/$kind.yaml <<YAML
teacher: /tmp/teacher
attention: $att
lora: {rank: 8, alpha: 16}
data:
  train: {path: .gpu/data/train-01.jsonl.zst}
  eval: {path: .gpu/data/valid.jsonl.zst}
  seq_len: 1024
  batch_size: 8
stage1: {steps: ${STAGE_STEPS:-150}}
stage2: {steps: ${STAGE_STEPS:-150}}
train: {device: cuda, log_every: 25}
checkpoint: {every: 0, keep: 1}
output: /tmp/lin-$kind
YAML
  T1=$(date +%s)
  $A linearize /tmp/$kind.yaml --quiet 2>&1 | tail -20 | tee -a "$OUT/still.log"
  echo "$kind wall $(( $(date +%s) - T1 )) s" | tee -a "$OUT/still.log"
  cp /tmp/lin-$kind/metrics.jsonl "$OUT/$kind-metrics.jsonl" 2>/dev/null
done
