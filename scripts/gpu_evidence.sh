#!/usr/bin/env bash
# Issue 18's evidence runs on one H200, in device calls of at most 9 minutes each:
#   70m   sweeps/dar-evidence-reduced.yaml: Pythia-70M vanilla / DAR d128 w128 small_init and
#         orthogonal / uniform d128 / window-only w128, seeds 1–3 (15 runs, ~1.5 min each)
#   14m   sweeps/dar-window-ablation-reduced.yaml: Pythia-14M, w ∈ {0,1,2,3,4,16,128} + vanilla,
#         seeds 1–2 (16 runs, well under a minute each)
# Both on the recipe of experiments/pythia-70m-evidence.yaml (T 1024, batch 64, 609 steps = three
# passes over wiki-gutenberg train shards 0–2, eval every 100 steps on its valid split and WikiText-2).
# Issue 27's long-range phases (the window-only control on data where it must fail):
#   recall sweeps/dar-longrange-reduced.yaml: d 128, 4 layers, T 512 on the synthetic recall corpus
#          (facts asked ≥ 256 tokens after they are stated), vanilla / DAR d32 w32 / uniform d32 /
#          window-only w32, seeds 1–3 (12 runs, 800 steps each; no data files needed), then
#          `eval --task recall --lengths 16,256 --samples 200` per run. Its own results folder and
#          archive: results/gpu-longrange, $OUT/longrange-runs.tgz (RESTORE_LR to restore).
#   niah   sweeps/dar-longrange-niah-reduced.yaml: the needle-teacher recipe × the same four arms,
#          then S-NIAH-1 at 512 and 1024 (needs $D/gpt-neox-20b.json, train-0{0,1}.jsonl.zst,
#          valid.jsonl.zst and ruler_paul_graham_essays.json.gz; several minutes per run).
#
# Usage (from the repo root, with .gpu/attnlab from `make gpu-bin` and .gpu/data/ (`make gpu-data`) holding
# gpt-neox-20b.json, train-0{0,1,2}.jsonl.zst, valid.jsonl.zst and test.raw.txt, as for
# scripts/gpu_sweep.sh; carry `.gpu`):
#   scripts/gpu_evidence.sh            # both phases, 70m first; stops itself after $BUDGET seconds
#   scripts/gpu_evidence.sh 14m        # one phase
#   scripts/gpu_evidence.sh recall     # the long-range recall sweep (only .gpu/attnlab needed)
#   SEEDS="4 5" scripts/gpu_evidence.sh 70m   # more seeds of a sweep (two calls of BUDGET=490 for 10 runs)
# Call it again until the log says "all runs DONE": sweeps skip finished runs and resume cut-off ones
# from their last checkpoint (every 100 steps) while the machine stays warm. On a fresh machine the
# finished runs of earlier calls come back from $RESTORE (default results/gpu-evidence-runs.tgz: copy
# the previous call's $OUT/evidence-runs.tgz there, and carry it); only unfinished runs are retrained.
# Every call leaves in $OUT: evidence-runs.tgz (config.yaml, metrics.jsonl, eval.json, DONE of every
# finished run: enough for `attnlab report`) and evidence.log. On the CPU machine:
#   mkdir -p results/gpu-evidence && tar xzf evidence-runs.tgz -C results/gpu-evidence
#   attnlab report results/gpu-evidence --out results/gpu-evidence/report            (word PPL)
#   attnlab report results/gpu-evidence --out results/gpu-evidence/report-token --unit token
# The window-only arm needs a binary with `kind: window` (issue 15); without it the 70m phase logs
# the planning error and the 14m phase still runs.
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
A=.gpu/attnlab; D=.gpu/data; R=results/gpu-evidence
BUDGET=${BUDGET:-470}            # seconds this call may train (the call must end within 540)
RESTORE=${RESTORE:-results/gpu-evidence-runs.tgz}
START=$(date +%s)
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$OUT/evidence.log"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

phases="${*:-70m 14m}"
needs_data=0
for p in $phases; do case $p in 70m|14m|niah) needs_data=1 ;; esac; done
[ -e $A ] || { log "missing $A (see the header of $0)"; exit 2; }
if [ $needs_data = 1 ]; then
  for f in $D/gpt-neox-20b.json $D/train-00.jsonl.zst $D/train-01.jsonl.zst $D/train-02.jsonl.zst $D/valid.jsonl.zst $D/test.raw.txt; do
    [ -e "$f" ] || { log "missing $f (see the header of $0)"; exit 2; }
  done
fi
case " $phases " in *" niah "*) [ -e $D/ruler_paul_graham_essays.json.gz ] || { log "missing $D/ruler_paul_graham_essays.json.gz (niah phase)"; exit 2; } ;; esac
if [ ! -d $R ] && [ -f "$RESTORE" ]; then
  mkdir -p $R && tar xzf "$RESTORE" -C $R && log "restored $(ls $R | wc -l) finished runs from $RESTORE"
fi
mkdir -p $R

# The data as carried to the host; every run of both sweeps gets the same overrides, so a repeated
# call resolves to the same run directories (and the report to one recipe per scale).
common=(--out $R --set data.tokenizer=$D/gpt-neox-20b.json
        --set "data.train.mix=[{path: $D/train-00.jsonl.zst}, {path: $D/train-01.jsonl.zst}, {path: $D/train-02.jsonl.zst}]"
        --set data.eval.wiki-gutenberg.path=$D/valid.jsonl.zst --set data.eval.wikitext.path=$D/test.raw.txt
        --set data.cache=/tmp/cache --set train.device=cuda)

# SEEDS (e.g. "4 5") replaces a sweep's seeds: list, so that more seeds of a finished sweep train
# alone (their run directories are new; the committed seeds' runs are neither needed nor retrained).
with_seeds() { # FILE → the sweep file to run
  if [ -z "${SEEDS:-}" ]; then echo sweeps/$1; return; fi
  local f=sweeps/.seeds-$1
  sed -e "s/^seeds: .*/seeds: [${SEEDS// /, }]/" sweeps/$1 > $f && echo $f
}

owed=0; swept=0
sweep() { # FILE
  local t=$(left) file=$(with_seeds $1) rc=0
  swept=1
  if [ "$t" -lt 60 ]; then
    log "no time left for $1 this call"
  else
    log "sweep $file (up to ${t}s)"
    # timeout signals its whole process group: the sweep and the training run it launched.
    timeout --kill-after=15 "$t" $A sweep $file "${common[@]}" 2>&1 | grep -v "^sweep: \[" | tail -25 | tee -a "$OUT/evidence.log"
    rc=${PIPESTATUS[0]}
  fi
  # Runs of this sweep not yet DONE, by its own plan (a run not started has no directory yet); a
  # sweep that cannot be planned counts as owed.
  local plan
  if plan=$($A sweep $file "${common[@]}" --dry-run 2>&1); then
    owed=$(( owed + $(tail -n +3 <<< "$plan" | grep -vc ' done$') ))
  else
    owed=$(( owed + 1 )); log "$1: no plan: $(tail -1 <<< "$plan")"
  fi
  [ "$file" = sweeps/$1 ] || rm -f "$file"
  [ "$rc" = 124 ] && log "$1: stopped at the time budget; call again to continue"
  [ "$rc" != 0 ] && [ "$rc" != 124 ] && log "$1: exit $rc"
}

# The long-range phases: their own results folder, no wiki-gutenberg overrides (recall needs no
# files), and after training the long-range score of every finished run that lacks it.
LR=results/gpu-longrange
RESTORE_LR=${RESTORE_LR:-results/gpu-longrange-runs.tgz}
longrange() { # SWEEP EVAL-ARGS...
  local file=$1; shift
  if [ ! -d $LR ] && [ -f "$RESTORE_LR" ]; then
    mkdir -p $LR && tar xzf "$RESTORE_LR" -C $LR && log "restored $(ls $LR | wc -l) long-range runs from $RESTORE_LR"
  fi
  mkdir -p $LR
  local t=$(left)
  if [ "$t" -lt 60 ]; then log "no time left for $file this call"; return; fi
  log "sweep $file (up to ${t}s)"
  local extra=()
  [ "$file" = dar-longrange-niah-reduced.yaml ] && extra=(--set data.tokenizer=$D/gpt-neox-20b.json
        --set "data.train.mix=[{path: $D/train-00.jsonl.zst}, {path: $D/train-01.jsonl.zst}, {needles: {tasks: [niah_single_1, niah_single_2, niah_single_3, niah_multikey_1], docs: 30000, min_words: 60, max_words: 700, essay: $D/ruler_paul_graham_essays.json.gz}}]"
        --set data.eval.valid.path=$D/valid.jsonl.zst --set data.cache=/tmp/cache)
  timeout --kill-after=15 "$t" $A sweep sweeps/$file --out $LR --set train.device=cuda "${extra[@]}" 2>&1 | grep -v "^sweep: \[" | tail -25 | tee -a "$OUT/evidence.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && log "$file: stopped at the time budget; call again to continue"
  local marker=recall.json; [ "$1" = --task ] && [ "${2#ruler:}" != "$2" ] && marker=ruler.json
  for d in $LR/*/; do
    [ -f "$d/DONE" ] && [ ! -f "$d/$marker" ] || continue
    # A run restored from an archive has no checkpoint: only a sweep that scores in the run (the
    # niah sweep's eval.ruler) keeps its score across calls.
    if [ ! -d "$d/checkpoints" ]; then log "cannot score $d: no checkpoint on this machine"; continue; fi
    if [ "$(left)" -lt 20 ]; then log "no time left to score $d"; break; fi
    timeout --kill-after=5 "$(left)" $A eval "$d" "$@" 2>&1 | grep -v "\[.*\]" | tail -6 | tee -a "$OUT/evidence.log"
  done
}

for phase in $phases; do
  for p in $phase; do
    case $p in
      70m) sweep dar-evidence-reduced.yaml ;;
      14m) sweep dar-window-ablation-reduced.yaml ;;
      recall) longrange dar-longrange-reduced.yaml --task recall --lengths 16,256 --samples 200 ;;
      niah) longrange dar-longrange-niah-reduced.yaml --task ruler:niah_single_1 --lengths 512,1024 --samples 100 --max-new-tokens 12 ;;
      *) log "unknown phase $p (70m, 14m, recall, niah)" ;;
    esac
  done
done

if [ -d $LR ]; then
  lr_done=$(cd $LR && for d in */; do [ -f "$d/DONE" ] && echo "${d%/}"; done)
  if [ -n "$lr_done" ]; then
    (cd $LR && tar czf "$OUT/longrange-runs.tgz" --ignore-failed-read $(for d in $lr_done; do echo $d/config.yaml $d/metrics.jsonl $d/eval.json $d/DONE $d/recall.json $d/ruler.json; done) 2>/dev/null)
    log "long-range: $(echo "$lr_done" | grep -c .) runs finished, $(ls $LR/*/recall.json $LR/*/ruler.json 2>/dev/null | wc -l) scored → longrange-runs.tgz"
  fi
fi

# Pack the small files of every finished run (the device returns few, small files: one archive).
done_runs=$(cd $R && for d in */; do [ -f "$d/DONE" ] && echo "${d%/}"; done)
if [ -n "$done_runs" ]; then
  (cd $R && tar czf "$OUT/evidence-runs.tgz" --ignore-failed-read $(for d in $done_runs; do echo $d/config.yaml $d/metrics.jsonl $d/eval.json $d/DONE; done) 2>/dev/null)
fi
n_done=$(echo "$done_runs" | grep -c . || true)
n_all=$(ls -d $R/*/ 2>/dev/null | grep -vc /specs/ || true)
log "$n_done runs finished ($n_all run directories); $owed of this call's sweeps' runs not DONE; $(( $(date +%s) - START )) s"
[ "$swept" = 1 ] && [ "$owed" = 0 ] && log "all runs DONE"
exit 0
