#!/usr/bin/env bash
# STILL ablations at reduced scale on the GPU host (issues 5 and 6), in phases that each fit one call:
#   teacher    train the llama-30m needle teacher (experiments/llama-30m-needle-teacher.yaml) and
#              measure its own S-NIAH-1/2 at 0.5K and 1K (it must retrieve before students can)
#   routing    the routing-metric sweep (7 linearizations) + S-NIAH-1 at 0.5K/1K for each
#   components the component sweep (5 STILL variants + LoLCATs) + BABILong qa1/qa2 at 1K + S-NIAH-1
# The teacher is kept in results/gpu-still/teacher between calls while the machine stays warm and
# retrained (about 2 minutes) otherwise. Everything the report needs is copied to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
A=.gpu/attnlab; D=.gpu/data; R=results/gpu-still; T=$R/needle-teacher
ESSAY=$D/ruler_paul_graham_essays.json.gz
SAMPLES=${SAMPLES:-40}
LOG="$OUT/still-ablation.log"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

source "$(dirname "$0")/still_teacher.sh"

niah() { # RUN TASK LENGTHS
  $A eval "$1" --task ruler:$2 --lengths $3 --samples $SAMPLES --max-new-tokens 12 --essay $ESSAY 2>&1 | tail -4 | tee -a "$OUT/still-ablation.log"
}

sweep() { # FILE
  $A sweep sweeps/$1 --out $R --set teacher=$T --set data.eval.path=$D/valid.jsonl.zst \
    --set "data.train.mix=[{path: $D/train-02.jsonl.zst}, {needles: {docs: 400, seed: 7, min_words: 60, max_words: 700, essay: $ESSAY}}]" \
    --set train.device=cuda ${STAGE_STEPS:+--set stage1.steps=$STAGE_STEPS --set stage2.steps=$STAGE_STEPS} 2>&1 | tail -15 | tee -a "$OUT/still-ablation.log"
}

collect() { # one archive: the device returns at most 8 files
  (cd $R && tar czf "$OUT/still-runs.tgz" --ignore-failed-read */config.yaml */metrics.jsonl */eval.json */ruler.json */babilong.json */DONE 2>/dev/null)
}

for phase in "${@:-teacher}"; do
  case $phase in
    teacher) teacher; niah $T niah_single_1 512,1024; niah $T niah_single_2 512,1024 ;;
    routing) teacher; sweep still-routing-reduced.yaml
      for d in $R/still-*/; do case $d in *gate*) continue ;; esac; niah $d niah_single_1 512,1024; done ;;
    components) teacher; sweep still-components-reduced.yaml
      for d in $R/*gate*/ $R/lolcats*/; do
        niah $d niah_single_1 512,1024
        for q in qa1 qa2; do $A eval $d --task babilong:$q --lengths 1024 --samples $SAMPLES --essay $ESSAY --babi $D/babi 2>&1 | tail -3 | tee -a "$OUT/still-ablation.log"; done
      done ;;
  esac
  log "phase $phase done"
done
collect
