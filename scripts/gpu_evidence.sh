#!/usr/bin/env bash
# Issue 18's evidence runs on one H200, in device calls of at most 9 minutes each:
#   70m   sweeps/dar-evidence-reduced.yaml: Pythia-70M vanilla / DAR d128 w128 small_init and
#         orthogonal / uniform d128 / window-only w128, seeds 1–3 (15 runs, ~1.5 min each)
#   14m   sweeps/dar-window-ablation-reduced.yaml: Pythia-14M, w ∈ {0,1,2,3,4,16,128} + vanilla,
#         seeds 1–2 (16 runs, well under a minute each)
# Both on the recipe of experiments/pythia-70m-evidence.yaml (T 1024, batch 64, 609 steps = three
# passes over wiki-gutenberg train shards 0–2, eval every 100 steps on its valid split and WikiText-2).
#
# Usage (from the repo root, with .gpu/attnlab from `make gpu-bin` and .gpu/data/ holding
# gpt-neox-20b.json, train-0{0,1,2}.jsonl.zst, valid.jsonl.zst and test.raw.txt, as for
# scripts/gpu_sweep.sh; carry `.gpu`):
#   scripts/gpu_evidence.sh            # both phases, 70m first; stops itself after $BUDGET seconds
#   scripts/gpu_evidence.sh 14m        # one phase
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

for f in $A $D/gpt-neox-20b.json $D/train-00.jsonl.zst $D/train-01.jsonl.zst $D/train-02.jsonl.zst $D/valid.jsonl.zst $D/test.raw.txt; do
  [ -e "$f" ] || { log "missing $f (see the header of $0)"; exit 2; }
done
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

sweep() { # FILE
  local t=$(left)
  if [ "$t" -lt 60 ]; then log "no time left for $1 this call"; return; fi
  log "sweep $1 (up to ${t}s)"
  # timeout signals its whole process group: the sweep and the training run it launched.
  timeout --kill-after=15 "$t" $A sweep sweeps/$1 "${common[@]}" 2>&1 | grep -v "^sweep: \[" | tail -25 | tee -a "$OUT/evidence.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && log "$1: stopped at the time budget; call again to continue"
  [ "$rc" != 0 ] && [ "$rc" != 124 ] && log "$1: exit $rc"
}

for phase in "${@:-70m 14m}"; do
  for p in $phase; do
    case $p in
      70m) sweep dar-evidence-reduced.yaml ;;
      14m) sweep dar-window-ablation-reduced.yaml ;;
      *) log "unknown phase $p (70m, 14m)" ;;
    esac
  done
done

# Pack the small files of every finished run (the device returns few, small files: one archive).
done_runs=$(cd $R && for d in */; do [ -f "$d/DONE" ] && echo "${d%/}"; done)
if [ -n "$done_runs" ]; then
  (cd $R && tar czf "$OUT/evidence-runs.tgz" --ignore-failed-read $(for d in $done_runs; do echo $d/config.yaml $d/metrics.jsonl $d/eval.json $d/DONE; done) 2>/dev/null)
fi
n_done=$(echo "$done_runs" | grep -c . || true)
n_all=$(ls -d $R/*/ 2>/dev/null | grep -vc /specs/ || true)
log "$n_done of 31 runs finished ($n_all run directories) in $(( $(date +%s) - START )) s"
[ "$n_done" -ge 31 ] && log "all runs DONE"
exit 0
