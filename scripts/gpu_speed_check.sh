#!/usr/bin/env bash
# Did a refactor change speed? Two lean binaries side by side in one GPU job, interleaved so that drift
# hits both alike: .gpu/attnlab-before (built from the commit before) and .gpu/attnlab (now). Per
# binary: the fast-path correctness check (now only), the attention-op timings (T 2048, 4096), training
# throughput of vanilla / DAR / uniform at Pythia 70M and 160M, and decode speed and cache bytes
# (vanilla, DAR, STILL, LoLCATs at 1K and 4K context). Writes $OUT/speed.jsonl (every row tagged
# "bin": before|after) and $OUT/speed.md (after / before ratios).
# Usage on the GPU host, from the repo root: OUT=... scripts/gpu_speed_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
PY=${PY:-/opt/torch/.venv/bin/python}
LOG="$OUT/speed.log"
tag() { grep '^{' | sed "s/^{/{\"bin\":\"$1\",\"what\":\"$2\",/" >> "$OUT/speed.jsonl"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "[$(date +%T)] check" | tee -a "$LOG"
.gpu/attnlab bench --check --set model.flavor=pythia-70m --set data.train.synthetic.docs=1 --set train.batch_size=2 --set data.seq_len=2048 2>&1 | tee -a "$LOG" | tail -20
bin_path() { if [ $1 = before ]; then echo .gpu/attnlab-before; else echo .gpu/attnlab; fi; }
# Every measurement runs before, then after, back to back (drift hits both alike).
for T in 2048 4096 2048 4096; do
  for bin in before after; do
    $(bin_path $bin) bench --attention-only --json --steps 30 --set model.flavor=pythia-70m --set train.batch_size=16 --set data.seq_len=$T --set attention.window=128 2>>"$LOG" | tag $bin attn
  done
done
echo "[$(date +%T)] train" | tee -a "$LOG"
for size in 70m:64:128 160m:32:192; do
  IFS=: read -r f b dd <<< "$size"
  for att in "{kind: vanilla}" "{kind: dar, d_down: $dd, window: 128}" "{kind: uniform, d_down: $dd}"; do
    for bin in before after; do
      $(bin_path $bin) bench experiments/pythia-70m-vanilla.yaml --json --steps 12 --warmup 4 --set model.flavor=pythia-$f \
        --set train.batch_size=$b --set "attention=$att" 2>>"$LOG" | tag $bin train
    done
  done
done
echo "[$(date +%T)] train loop" | tee -a "$LOG"
# The real training loop (data loader, accumulation, logging), not only a step: 40 steps of Pythia-70M
# on synthetic documents; tokens/s of the last logged row (steps 21-40).
for name in vanilla dar; do
  att="{kind: vanilla}"; [ $name = dar ] && att="{kind: dar, d_down: 128, window: 128}"
  for bin in before after; do
    rm -rf /tmp/loop-$bin
    $(bin_path $bin) train experiments/pythia-70m-vanilla.yaml --quiet --out /tmp/loop-$bin --set "attention=$att" \
      --set train.steps=40 --set train.batch_size=32 --set train.log_every=20 --set data.tokenizer=.gpu/data/gpt-neox-20b.json \
      --set 'data.train={synthetic: {docs: 3000, seed: 1}}' --set 'data.eval={}' --set data.cache=/tmp/cache-$bin 2>>"$LOG" >/dev/null
    grep '"tokens_per_s"' /tmp/loop-$bin/metrics.jsonl | tail -1 | sed "s/^{/{\"attention\":\"$name\",/" | tag $bin loop
  done
done
echo "[$(date +%T)] decode" | tee -a "$LOG"
for bin in before after; do
  $(bin_path $bin) bench-decode experiments/pythia-70m-dar.yaml --json --lengths 1024,4096 --attention vanilla,dar,still,lolcats --new-tokens 32 2>>"$LOG" | tag $bin decode
done
echo "[$(date +%T)] done" | tee -a "$LOG"
$PY - "$OUT" <<'PY' | tee "$OUT/speed.md"
import json, sys, statistics as st
from collections import defaultdict
rows = [json.loads(l) for l in open(sys.argv[1] + "/speed.jsonl")]
def key(r):
    return (r["what"], r.get("flavor", ""), r.get("seq_len", r.get("context", "")), r.get("attention", ""), r.get("implementation", ""))
val = {"attn": "fwd_bwd_ms", "train": "tokens_per_s", "loop": "tokens_per_s", "decode": "decode_tokens_per_s"}
by = defaultdict(lambda: defaultdict(list))
for r in rows:
    m = val[r["what"]]
    if m in r:
        by[key(r)][r["bin"]].append(r[m])
print("| what | model | T | attention | impl | metric | before | after | after / before |")
print("|---|---|---:|---|---|---|---:|---:|---:|")
for k, v in sorted(by.items(), key=lambda kv: str(kv[0])):
    if "before" in v and "after" in v:
        b, a = st.median(v["before"]), st.median(v["after"])
        print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {val[k[0]]} | {b:,.3f} | {a:,.3f} | {a / b:.3f} |")
cache = defaultdict(dict)
for r in rows:
    if r["what"] == "decode" and "cache_bytes" in r:
        cache[(r["attention"], r["context"])][r["bin"]] = r["cache_bytes"]
if cache:
    print("\n| decode cache | T | before bytes | after bytes |\n|---|---:|---:|---:|")
    for (a, t), v in sorted(cache.items()):
        print(f"| {a} | {t} | {v.get('before', '–')} | {v.get('after', '–')} |")
PY
ls -la "$OUT"
