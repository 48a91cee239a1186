#!/usr/bin/env bash
# Data parallelism on the 2-GPU host (issue 11): training tokens/s of Pythia-70M and 160M, vanilla
# and DAR, on 1 vs 2 GPUs at the same per-GPU micro-batch (T = 2048, bf16), then a 300-step
# Pythia-70M loss curve on 1 GPU vs 2 GPUs with the same global batch. Needs .gpu/attnlab and
# .gpu/data/ as scripts/gpu_train.sh. Writes $OUT/ddp_speed.jsonl, $OUT/curve_{1,2}gpu.jsonl,
# $OUT/summary.txt and $OUT/log.txt. About 5 minutes (each command capped by `timeout`).
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
PY=${PY:-/opt/torch/.venv/bin/python}
A=.gpu/attnlab
RUNS=/tmp/ddp-runs; rm -rf $RUNS; mkdir -p $RUNS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
run() { echo "+ $*" | tee -a "$OUT/log.txt"; timeout "${LIMIT:-150}" "$@" >> "$OUT/log.txt" 2>&1; echo "  exit $?" | tee -a "$OUT/log.txt"; }
data=(--set data.tokenizer=.gpu/data/gpt-neox-20b.json --set 'data.train.path=.gpu/data/train-*.jsonl.zst'
      --set data.cache=/tmp/cache --set 'data.eval={}' --set checkpoint.every=0 --quiet)
spec=experiments/pythia-70m-vanilla.yaml

# Tokenize the corpus once (cached in /tmp/cache), outside the timed runs.
LIMIT=300 run $A train $spec "${data[@]}" --set train.steps=1 --set train.batch_size=1 --out $RUNS/warm

# Throughput: S steps, tokens/s of the last logged window (steps S/2+1..S, after warm-up).
S=${S:-60}
for size in 70m:32:128 160m:16:192; do
  IFS=: read -r f b dd <<< "$size"
  for att in vanilla dar; do
    if [ $att = vanilla ]; then a="{kind: vanilla}"; else a="{kind: dar, d_down: $dd, window: 128}"; fi
    for g in 1 2; do
      name=$f-$att-${g}gpu
      gpus=(); [ $g = 2 ] && gpus=(--gpus 0,1)
      # Same micro-batch b per GPU: the global batch is g·b, split into g micro-batches of b.
      run $A train $spec "${data[@]}" --set model.flavor=pythia-$f --set "attention=$a" --set train.steps=$S \
        --set train.log_every=$((S / 2)) --set train.batch_size=$((g * b)) --set train.grad_accum=$g "${gpus[@]}" --out $RUNS/$name
      # The last training row (the final eval row has no tokens_per_s).
      tps=$($PY -c 'import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if "tokens_per_s" in r][-1]["tokens_per_s"])' $RUNS/$name/metrics.jsonl 2>/dev/null || echo 0)
      echo "{\"model\":\"pythia-$f\",\"attention\":\"$att\",\"gpus\":$g,\"micro_batch_per_gpu\":$b,\"seq_len\":2048,\"tokens_per_s\":$tps}" | tee -a "$OUT/ddp_speed.jsonl"
    done
  done
done

# Loss curve: 300 steps, global batch 32 × 2048, on 1 GPU (2 micro-batches of 16) and 2 GPUs (16 each).
curve=(--set train.steps=300 --set train.log_every=10 --set train.batch_size=32 --set train.grad_accum=2)
LIMIT=240 run $A train $spec "${data[@]}" "${curve[@]}" --out $RUNS/curve1
cp $RUNS/curve1/metrics.jsonl "$OUT/curve_1gpu.jsonl" 2>/dev/null
LIMIT=180 run $A train $spec "${data[@]}" "${curve[@]}" --gpus 0,1 --out $RUNS/curve2
cp $RUNS/curve2/metrics.jsonl "$OUT/curve_2gpu.jsonl" 2>/dev/null

$PY - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys, os
out = sys.argv[1]
rows = [json.loads(l) for l in open(os.path.join(out, "ddp_speed.jsonl"))] if os.path.exists(os.path.join(out, "ddp_speed.jsonl")) else []
by = {(r["model"], r["attention"], r["gpus"]): r["tokens_per_s"] for r in rows}
print("model        attention  1 GPU tok/s  2 GPU tok/s  speed-up")
for (m, a, g), t in sorted(by.items()):
    if g == 1:
        t2 = by.get((m, a, 2), 0)
        print(f"{m:12} {a:9} {t:12.0f} {t2:12.0f} {t2 / t if t else 0:9.2f}x")
def curve(p):
    try:
        return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r}
    except FileNotFoundError:
        return {}
c1, c2 = curve(os.path.join(out, "curve_1gpu.jsonl")), curve(os.path.join(out, "curve_2gpu.jsonl"))
common = sorted(set(c1) & set(c2))
if common:
    d = [abs(c1[s] - c2[s]) for s in common]
    print(f"loss curves: {len(common)} common steps, max |diff| {max(d):.4f}, mean |diff| {sum(d)/len(d):.4f}, final {c1[common[-1]]:.4f} (1 GPU) vs {c2[common[-1]]:.4f} (2 GPUs)")
    for s in common[::5] + [common[-1]]:
        print(f"  step {s:4}: {c1[s]:.4f}  {c2[s]:.4f}")
else:
    print("loss curves: missing (see log.txt)")
PYEOF
