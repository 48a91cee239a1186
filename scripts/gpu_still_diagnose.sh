#!/usr/bin/env bash
# Why STILL's selected tokens don't retrieve (issue 18 item 6; run by issue 20 item 4): one STILL
# student of the llama-30m needle teacher, re-evaluated WITH THE SAME WEIGHTS at several κ, with the
# oracle (the needle sentences selected), without the linear branch and with the max-compensated
# normalizer; then a student trained with the compensated normalizer. Every eval writes ruler.json
# cells tagged with their --set overrides and per-sample records (needle token positions, value tokens
# in window / selected / neither per layer, normalizer shares) in ruler_samples/. Phases, each one
# device call (≤ 9 minutes):
#   teacher   train the needle teacher (~3 min) and check it retrieves
#   student   linearize one STILL student (sweeps/still-ablation-reduced recipe, κ 4)
#   curve     κ ∈ {4, 8, 16, 32, 48, 63} on the student (50 samples, 0.5K and 1K)
#   controls  oracle, oracle + linear off, linear off, max_compensated at κ 4 / 16 / 48
#   compensated  linearize a student with normalizer: max_compensated, evaluate it at κ 4 and 16
# Usage on the host: OUT=... scripts/gpu_still_diagnose.sh teacher student curve   (phases in order;
# the teacher and student stay in results/gpu-still-diag while the machine is warm, else retrained).
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
A=.gpu/attnlab; D=.gpu/data; R=results/gpu-still-diag; T=$R/teacher; S=$R/student; SC=$R/student-compensated
ESSAY=$D/ruler_paul_graham_essays.json.gz
SAMPLES=${SAMPLES:-50}
LOG="$OUT/still-diagnose.log"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

source "$(dirname "$0")/still_teacher.sh"

student() { # DIR [extra --set ...]
  local dir=$1; shift
  if [ -f $dir/DONE ]; then log "$dir present"; return; fi
  $A linearize experiments/still-ablation-reduced.yaml --quiet --out $dir --set teacher=$T \
    --set data.eval.path=$D/valid.jsonl.zst \
    --set "data.train.mix=[{path: $D/train-02.jsonl.zst}, {needles: {docs: 400, seed: 7, min_words: 60, max_words: 700, essay: $ESSAY}}]" \
    --set train.device=cuda "$@" 2>&1 | tail -6 | tee -a "$OUT/still-diagnose.log"
}

niah() { # RUN [--set ...]
  local run=$1; shift
  $A eval "$run" --task ruler:niah_single_1 --lengths 512,1024 --samples $SAMPLES --max-new-tokens 12 --essay $ESSAY "$@" 2>&1 | tail -40 | tee -a "$OUT/still-diagnose.log"
}

collect() {
  (cd $R && tar czf "$OUT/still-diagnose.tgz" --ignore-failed-read */config.yaml */metrics.jsonl */eval.json */ruler.json */ruler_samples */DONE 2>/dev/null)
}

for phase in "$@"; do
  case $phase in
    teacher) teacher; niah $T ;;
    student) teacher; student $S ;;
    curve) for k in 4 8 16 32 48 63; do niah $S --set attention.tokens_per_chunk=$k; done ;;
    controls)
      niah $S --set attention.routing=oracle
      niah $S --set attention.routing=oracle --set attention.linear_branch=false
      niah $S --set attention.linear_branch=false
      for k in 4 16 48; do niah $S --set attention.tokens_per_chunk=$k --set attention.normalizer=max_compensated; done ;;
    compensated) teacher; student $SC --set attention.normalizer=max_compensated
      for k in 4 16; do niah $SC --set attention.tokens_per_chunk=$k; done ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
  log "phase $phase done"
done
collect
