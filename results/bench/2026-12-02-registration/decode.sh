#!/usr/bin/env bash
# Decode before (old) and after (new) the refactor, interleaved: bench-decode at Pythia-70M size.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
for r in 0 1; do
  for which in old new; do
    att=vanilla,dar,uniform,window; [ $which = new ] && att=$att,sink
    timeout 200 $1/$which bench-decode experiments/pythia-70m-dar.yaml --json --lengths 4096,16384 --attention $att --new-tokens 64 --set train.device=cuda 2>>"$OUT/err.txt" \
      | grep '^{' | sed "s/^{/{\"bin\":\"$which\",\"round\":$r,/" >> "$OUT/decode.jsonl"
  done
done
tail -3 "$OUT/err.txt"; wc -l "$OUT"/decode.jsonl
