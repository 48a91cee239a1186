#!/usr/bin/env bash
# Issue 36 item 1 on one H200: the recall learning-curve sweep (sweeps/dar-recall-curves-reduced.yaml),
# the seeds in SEEDS (default "1"), every arm of a seed at once on the one GPU (a 4-layer d-128 model
# leaves the H200 mostly idle: SLOTS concurrent runs, default 7), under BUDGET_S seconds (default 480).
# The run directories are the full sweep's (same config hashes), so a later call or a bigger machine
# carries on. Small files of every run (config.yaml, metrics.jsonl — the curve so far, scored every
# 500 steps — recall.json, eval.json, DONE) go to $OUT/recall-curves.tgz, finished or not; checkpoints
# stay behind. Expects .gpu/attnlab (make gpu-bin).
# Carry results/dar-recall-curves only on a fresh machine (finished runs are skipped). To carry on with
# cut-off runs on the still-warm machine, carry .gpu alone: a carried copy replaces the machine's folder,
# and the runs lose their checkpoints (they start over; the trainer moves their earlier rows to
# metrics.discarded.jsonl). The tarball of a resumed call holds only the rows since the resume
# checkpoint: put the previous call's rows before them (the 2026-12-06 seed-4 runs were joined so).
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
A=.gpu/attnlab; SEEDS=${SEEDS:-1}; SLOTS=${SLOTS:-7}; BUDGET_S=${BUDGET_S:-480}
R=results/dar-recall-curves
sweep=$(mktemp --suffix=.yaml -p sweeps)
sed "s/^seeds: .*/seeds: [${SEEDS// /, }]/" sweeps/dar-recall-curves-reduced.yaml > "$sweep"
gpus=$(printf '0,%.0s' $(seq "$SLOTS")); gpus=${gpus%,}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout --signal=INT "$BUDGET_S" $A sweep "$sweep" --gpus "$gpus" > "$OUT/sweep.log" 2>&1
echo "sweep exit $? after ${SECONDS}s" | tee -a "$OUT/sweep.log"
rm -f "$sweep"
(cd "$R" && tar czf "$OUT/recall-curves.tgz" --ignore-failed-read $(for d in */; do for f in config.yaml metrics.jsonl recall.json eval.json DONE; do [ -e "$d$f" ] && echo "$d$f"; done; done))
for d in "$R"/*/; do [ -e "$d/config.yaml" ] || continue; echo "$(basename "$d"): $(grep -c '"recall/' "$d/metrics.jsonl" 2>/dev/null) recall rows, last step $(tail -1 "$d/metrics.jsonl" 2>/dev/null | grep -o '"step":[0-9]*'), $( [ -e "$d/DONE" ] && echo done || echo partial)"; done | tee "$OUT/status.txt"
