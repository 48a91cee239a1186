#!/usr/bin/env bash
# Issue 36 on one GPU: a recall sweep (default sweeps/dar-recall-curves-reduced.yaml, item 1's learning
# curves; SWEEP=sweeps/dar-recall-capacity-reduced.yaml for item 3's capacity curves), the seeds in
# SEEDS (default "1"), the runs of those seeds at once on the one GPU (a 4-layer d-128 model leaves an
# H100 / H200 mostly idle: SLOTS concurrent runs, default 7), under BUDGET_S seconds (default 480).
# For the capacity sweep FACTS (e.g. "2 8 32") and WIDTHS (DAR d_down, e.g. "32 128") cut its grid to
# what a session's device time holds (50 runs in full). The run directories are the full sweep's (same
# config hashes), so a later call or a bigger machine carries on. Small files of every run
# (config.yaml, metrics.jsonl — the curve so far, scored every 500 steps — recall.json, eval.json,
# DONE) go to $OUT/recall-curves.tgz, finished or not; checkpoints stay behind. Expects .gpu/attnlab
# (make gpu-bin).
# Carry the results folder only on a fresh machine (finished runs are skipped). To carry on with
# cut-off runs on the still-warm machine, carry .gpu alone: a carried copy replaces the machine's folder,
# and the runs lose their checkpoints (they start over; the trainer moves their earlier rows to
# metrics.discarded.jsonl). The tarball of a resumed call holds only the rows since the resume
# checkpoint: put the previous call's rows before them (the 2026-12-06 seed-4 runs were joined so).
#   SEEDS="1 2" scripts/gpu_recall_curves.sh
#   SWEEP=sweeps/dar-recall-capacity-reduced.yaml FACTS="2 8 32" WIDTHS="32 128" SEEDS=1 SLOTS=9 scripts/gpu_recall_curves.sh
#   STEPS=16000 SEEDS=1 scripts/gpu_recall_curves.sh     # the curves run long enough to settle (3+ calls)
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
A=.gpu/attnlab; SEEDS=${SEEDS:-1}; SLOTS=${SLOTS:-7}; BUDGET_S=${BUDGET_S:-480}
SWEEP=${SWEEP:-sweeps/dar-recall-curves-reduced.yaml}
R=$(sed -n 's/^output: *//p' "$SWEEP")
[ -n "$R" ] || { echo "$SWEEP has no output: line" >&2; exit 2; }
list() { local x=$1; echo "${x// /, }"; }
sweep=$(mktemp --suffix=.yaml -p sweeps)
sed -e "s/^seeds: .*/seeds: [$(list "$SEEDS")]/" \
    ${FACTS:+-e "s/^grid: {data.train.synthetic.recall_facts: .*/grid: {data.train.synthetic.recall_facts: [$(list "$FACTS")]}/"} \
    ${WIDTHS:+-e "s/attention.d_down: \[[0-9, ]*\]/attention.d_down: [$(list "$WIDTHS")]/"} "$SWEEP" > "$sweep"
# STEPS (e.g. 16000) trains longer: another recipe (its learning-rate schedule spans the new length),
# so new run directories beside the 8,000-step ones, and a recipe of its own in the report.
steps=(${STEPS:+--set train.steps=$STEPS})
$A sweep "$sweep" "${steps[@]}" --dry-run > "$OUT/plan.txt" 2>&1 || { cat "$OUT/plan.txt"; rm -f "$sweep"; exit 2; }
head -1 "$OUT/plan.txt"
gpus=$(printf '0,%.0s' $(seq "$SLOTS")); gpus=${gpus%,}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout --signal=INT "$BUDGET_S" $A sweep "$sweep" "${steps[@]}" --gpus "$gpus" > "$OUT/sweep.log" 2>&1
echo "sweep exit $? after ${SECONDS}s" | tee -a "$OUT/sweep.log"
rm -f "$sweep"
(cd "$R" && tar czf "$OUT/recall-curves.tgz" --ignore-failed-read $(for d in */; do for f in config.yaml metrics.jsonl recall.json eval.json DONE; do [ -e "$d$f" ] && echo "$d$f"; done; done))
for d in "$R"/*/; do [ -e "$d/config.yaml" ] || continue; echo "$(basename "$d"): $(grep -c '"recall/' "$d/metrics.jsonl" 2>/dev/null) recall rows, last step $(tail -1 "$d/metrics.jsonl" 2>/dev/null | grep -o '"step":[0-9]*'), $( [ -e "$d/DONE" ] && echo done || echo partial)"; done | tee "$OUT/status.txt"
