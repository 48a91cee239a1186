#!/usr/bin/env bash
# Issue 25's "speed must not change": the binary before the refactor (2e8c0ae, .gpu/old) and after it
# (.gpu/new), interleaved, three rounds: the attention op alone (vanilla, DAR, uniform at T 4096)
# and the Pythia-70M training step (vanilla, DAR d128 w128) on synthetic tokens.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for r in 0 1 2; do
  for which in old new; do
    A=$1/$which
    $A bench --attention-only --json --steps 30 --set model.flavor=pythia-70m --set train.batch_size=16 --set data.seq_len=4096 --set attention.window=128 --set train.device=cuda 2>>"$OUT/err.txt" | grep '^{' | sed "s/^{/{\"bin\":\"$which\",\"round\":$r,/" >> "$OUT/attn.jsonl"
    for att in "{kind: vanilla}" "{kind: dar, d_down: 128, window: 128}"; do
      $A bench experiments/pythia-70m-vanilla.yaml --json --steps 15 --warmup 5 --set train.batch_size=16 --set data.seq_len=2048 --set train.device=cuda --set "attention=$att" 2>>"$OUT/err.txt" | grep '^{' | sed "s/^{/{\"bin\":\"$which\",\"round\":$r,/" >> "$OUT/train.jsonl"
    done
  done
done
tail -5 "$OUT/err.txt"; wc -l "$OUT"/*.jsonl
