#!/usr/bin/env bash
# scripts/gpu_still_diagnose.sh in single steps for calls that start bare: the same teacher, student
# and evals, given as an ordered list (most informative first), each eval archived as soon as it ends
# and skipped when the call's wall budget (BUDGET s from the script's start) would not hold it; the
# device returns what is under $OUT even when a call is stopped at its limit. Steps:
#   teacher      train the needle teacher and evaluate it      student   linearize the κ 4 student
#   k=N          the student at κ N                             oracle    routing oracle
#   oracle-nolin oracle + linear_branch false                   nolin     linear_branch false
#   comp=N       normalizer max_compensated at κ N
#   cstudent     linearize a student with normalizer max_compensated;  ck=N: that student at κ N
#   s:K=V,K=V    the student with --set attention.K=V for each pair (c:K=V,…: the compensated student)
# Usage: OUT=... SAMPLES=30 BUDGET=520 bash scripts/gpu_still_diagnose_steps.sh teacher student k=4 oracle ...
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
A=.gpu/attnlab; D=.gpu/data; R=results/gpu-still-diag; T=$R/teacher; S=$R/student; SC=$R/student-compensated
ESSAY=$D/ruler_paul_graham_essays.json.gz
SAMPLES=${SAMPLES:-30}; BUDGET=${BUDGET:-520}; START=$(date +%s); NEED=${EVAL_NEED:-45}
LOG="$OUT/still-diagnose.log"
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

source scripts/still_teacher.sh

student() { # DIR [extra --set ...]
  local dir=$1; shift
  if [ -f $dir/DONE ]; then log "$dir present"; return; fi
  local t0=$(date +%s)
  $A linearize experiments/still-ablation-reduced.yaml --quiet --out $dir --set teacher=$T \
    --set data.eval.path=$D/valid.jsonl.zst \
    --set "data.train.mix=[{path: $D/train-02.jsonl.zst}, {needles: {docs: 400, seed: 7, min_words: 60, max_words: 700, essay: $ESSAY}}]" \
    --set train.device=cuda "$@" 2>&1 | tail -6 | tee -a "$LOG"
  log "$dir linearized in $(( $(date +%s) - t0 )) s"
}

collect() {
  (cd $R && tar czf "$OUT/still-diagnose.tgz" --ignore-failed-read */config.yaml */metrics.jsonl */eval.json */ruler.json */ruler_samples */DONE 2>/dev/null)
}

niah() { # RUN [--set ...]: skipped when the budget left is under the last eval's time + 30%
  local run=$1; shift
  local left=$(( BUDGET - ($(date +%s) - START) ))
  if [ $left -lt $NEED ]; then log "SKIP eval $run $* ($left s left, need $NEED)"; return; fi
  local t0=$(date +%s)
  log "eval $run $*"
  $A eval "$run" --task ruler:niah_single_1 --lengths 512,1024 --samples $SAMPLES --max-new-tokens 12 --essay $ESSAY "$@" 2>&1 | tail -40 | tee -a "$LOG"
  local dt=$(( $(date +%s) - t0 )); NEED=$(( dt * 13 / 10 + 5 ))
  log "eval took $dt s"
  collect
}

for step in "$@"; do
  case $step in
    teacher) teacher; niah $T ;;
    student) teacher; student $S ;;
    k=*) niah $S --set attention.tokens_per_chunk=${step#k=} ;;
    oracle) niah $S --set attention.routing=oracle ;;
    oracle-nolin) niah $S --set attention.routing=oracle --set attention.linear_branch=false ;;
    nolin) niah $S --set attention.linear_branch=false ;;
    comp=*) niah $S --set attention.tokens_per_chunk=${step#comp=} --set attention.normalizer=max_compensated ;;
    cstudent) teacher; student $SC --set attention.normalizer=max_compensated ;;
    ck=*) niah $SC --set attention.tokens_per_chunk=${step#ck=} ;;
    s:*|c:*) run=$S; [ ${step%%:*} = c ] && run=$SC; sets=()
      IFS=, read -ra kv <<< "${step#*:}"; for x in "${kv[@]}"; do sets+=(--set "attention.$x"); done
      niah $run "${sets[@]}" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
  log "step $step done"
done
collect
nvidia-smi --query-gpu=name,memory.used --format=csv 2>&1 | tee -a "$LOG"
