#!/usr/bin/env bash
# Fault test of run directories (CPU, tiny spec, ~2 minutes on 2 cores). Run by the CLI test
# `fault_test_script_passes` (tests/cli.rs); by hand:
#
#     scripts/fault_test.sh [ATTNLAB_BINARY [WORK_DIR]]     (default target/release/attnlab, a temp dir)
#
# FAULT_SEED=N replays one sequence of random kills (the seed is printed first). What it checks:
#   1. SIGKILLs at random times, some timed to land inside checkpoint writes (a .tmp- folder
#      is there, held open by the test-only ATTNLAB_FAULT_INJECT=checkpoint-sleep-ms) and some
#      aimed at stages of the write (checkpoint-die-at=STAGE), then resuming until done → losses, eval.json and final weights bit-identical to an uninterrupted run.
#   2. A second writer on a run directory in use → refused at once (exit 75) naming the dir, the
#      holder's pid and host (also through the data-parallel launcher); under data parallelism
#      rank 0 holds the lock, and a SIGKILLed launcher takes its workers (and the lock) along;
#      readers (eval, generate, report) work while the lock is held.
#   3. A truncated newest checkpoint → renamed <step>.corrupt, the previous one used, same result;
#      no complete checkpoint left → a clear error.
#   4. No space left (injected ENOSPC while writing a checkpoint, then a metrics row; a real 3 MB
#      tmpfs where user namespaces allow mounting one) → a clear error, no .tmp- left, the last
#      checkpoint intact, and a re-run (after freeing space) finishes bit-identical.
#   5. A malformed metrics.jsonl line → report warns naming file and line.
#   6. A sweep killed (SIGKILL, then SIGINT) and relaunched → its children die with it, the
#      relaunch runs only the missing runs, and every run ends as in an uninterrupted sweep.
set -euo pipefail
shopt -s nullglob

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=$(realpath "${1:-${ATTNLAB:-$ROOT/target/release/attnlab}}")
WORK=${2:-$(mktemp -d)}
mkdir -p "$WORK"
WORK=$(realpath "$WORK")
cd "$WORK"
SEED=${FAULT_SEED:-$RANDOM}
RANDOM=$SEED
echo "fault test in $WORK (FAULT_SEED=$SEED)"
T0=$SECONDS

# One thread per process: the test runs several at once, beside other tests; and every run here
# must use the same thread count for bit-identical results.
export OMP_NUM_THREADS=1
STEPS=24
SETS=(--set train.steps=$STEPS --set train.log_every=1 --set checkpoint.every=4 --set checkpoint.keep=2
      --set train.device=cpu --set data.seq_len=64 --set train.batch_size=8
      --set data.train.synthetic.docs=300 --set data.eval.synthetic.synthetic.docs=40)

fail() { echo "FAIL: $*" >&2; exit 1; }
step() { echo "== [$((SECONDS - T0))s] $*"; }
train() { local dir=$1; shift; "$BIN" train --quiet --out "$dir" "${SETS[@]}" "$@"; }

# metrics.jsonl without its timings (elapsed_s, tokens_per_s differ between sessions), one line
# per distinct row: a row logged again after a resume is the same row.
norm() {
  sed -E 's/"(elapsed_s|tokens_per_s)":[^,}]*//g; s/,,+/,/g; s/\{,/{/; s/,\}/}/' "$1/metrics.jsonl" | sort -u
}
final_model() { echo "$1/checkpoints/$STEPS/model.safetensors"; }
# Run directory $1 ended exactly as the reference $2.
same() {
  [ -f "$1/DONE" ] || fail "$1 is not DONE"
  diff <(norm "$1") <(norm "$2") >/dev/null || { diff <(norm "$1") <(norm "$2") | head -5; fail "$1: metrics differ from $2"; }
  cmp -s "$1/eval.json" "$2/eval.json" || fail "$1: eval.json differs from $2"
  cmp -s "$(final_model "$1")" "$(final_model "$2")" || fail "$1: final weights differ from $2"
  ! compgen -G "$1/checkpoints/.tmp-*" >/dev/null || fail "$1: a .tmp- folder was left behind"
}
# Wait (at most $2 s) until the shell condition $1 holds.
wait_for() {
  local t=$((SECONDS + $2))
  until eval "$1"; do
    [ $SECONDS -lt $t ] || fail "timed out waiting for: $1"
    sleep 0.02
  done
}
# Whether process $1 runs (a zombie, dead but not yet reaped by a new parent, does not).
alive() {
  local st
  st=$(sed -E 's/.*\) (.).*/\1/' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}
pid_in() { sed -E 's/pid ([0-9]+) .*/\1/' "$1/lock"; }

step "reference run"
train ref
[ -f ref/DONE ] && [ -f "$(final_model ref)" ] || fail "reference run incomplete"

# ------------------------------------------------------------------------------------------------
step "1. random SIGKILLs, some inside checkpoint writes"
kills=0 inside=0
round=0
while (( (kills < 8 || inside < 3) && round < 30 )); do
  round=$((round + 1))
  # A round that let the run finish: start it over (the kills so far still count).
  [ -f kill/DONE ] && rm -rf kill
  if (( round % 2 == 0 )); then
    # Timed on the checkpoint's temporary folder: the kill lands inside the write of the second
    # checkpoint after the resume point (so that every round makes progress).
    last=$(ls kill/checkpoints 2>/dev/null | grep -E '^[0-9]+$' | sort -n | tail -1 || true)
    target=$(( ${last:-0} + 8 ))
    (( target <= STEPS )) || target=$STEPS
    ATTNLAB_FAULT_INJECT=checkpoint-sleep-ms=250 "$BIN" train --quiet --out kill "${SETS[@]}" >/dev/null 2>&1 &
    pid=$!
    t=$((SECONDS + 60))
    until [ -d "kill/checkpoints/.tmp-$target" ] || ! alive $pid; do
      [ $SECONDS -lt $t ] || fail "no checkpoint write seen"
      sleep 0.01
    done
    if alive $pid; then
      kill -9 $pid
      wait $pid 2>/dev/null || true
      compgen -G "kill/checkpoints/.tmp-*" >/dev/null && inside=$((inside + 1))
      kills=$((kills + 1))
    else
      wait $pid 2>/dev/null || true
    fi
  else
    "$BIN" train --quiet --out kill "${SETS[@]}" >/dev/null 2>&1 &
    pid=$!
    sleep "$((RANDOM % 2)).$((RANDOM % 10))$((RANDOM % 10))"
    if alive $pid; then
      kill -9 $pid
      kills=$((kills + 1))
    fi
    wait $pid 2>/dev/null || true
  fi
  for c in kill/checkpoints/*/; do
    [[ $c == *.tmp-* ]] && continue
    for f in model.safetensors optimizer.safetensors state.json; do
      [ -f "$c$f" ] || fail "kill $kills left an incomplete checkpoint $c (no $f)"
    done
  done
done
# Kills aimed at stages of a checkpoint write (the test-only checkpoint-die-at: the writer SIGKILLs
# itself there; src/train/checkpoint.rs aims 100 at every stage of the writer alone), in a run of
# their own: dies writing step 4 (twice), after renaming it, then while deleting it (keep 2, at 12).
for stage in model hashed renamed pruning; do
  # (In braces with stderr closed: bash would report "Killed" for each.)
  rc=0; { ATTNLAB_FAULT_INJECT=checkpoint-die-at=$stage "$BIN" train --quiet --out aimed "${SETS[@]}" >/dev/null 2>&1; } 2>/dev/null || rc=$?
  [ $rc -eq 137 ] || fail "checkpoint-die-at=$stage: exit $rc, want 137 (killed at that stage)"
  kills=$((kills + 1)) inside=$((inside + 1))
  for c in aimed/checkpoints/*/; do
    [[ $c == *.tmp-* ]] && continue
    for f in model.safetensors optimizer.safetensors state.json; do
      [ -f "$c$f" ] || fail "the kill at $stage left an incomplete checkpoint $c (no $f)"
    done
  done
done
train aimed >/dev/null
same aimed ref
train kill >/dev/null
same kill ref
! compgen -G "kill/checkpoints/*.corrupt*" >/dev/null || fail "a kill corrupted a checkpoint"
(( kills >= 8 && inside >= 3 )) || fail "only $kills kills, $inside inside a checkpoint write, in $round rounds"
echo "   $kills kills ($inside inside checkpoint writes): bit-identical to the reference"

# ------------------------------------------------------------------------------------------------
step "2. a second writer is refused; readers need no lock"
# The first writer is slowed down (1 s per checkpoint) so that it surely outlives the checks.
ATTNLAB_FAULT_INJECT=checkpoint-sleep-ms=1000 "$BIN" train --quiet --out busy "${SETS[@]}" >/dev/null 2>busy.err &
first=$!
wait_for "grep -q 'pid $first ' busy/lock 2>/dev/null" 60
t=$SECONDS
rc=0; train busy >/dev/null 2>second.err || rc=$?
[ $rc -eq 75 ] || { cat second.err; fail "second writer: exit $rc, want 75"; }
(( SECONDS - t < 10 )) || fail "second writer was not refused at once"
grep -q "$WORK/busy" second.err && grep -q "pid $first on host $(cat /proc/sys/kernel/hostname)" second.err || { cat second.err; fail "refusal does not name dir, pid and host"; }
rc=0; train busy --gpus cpu,cpu >/dev/null 2>second.err || rc=$?
[ $rc -eq 75 ] && grep -q "pid $first" second.err || { cat second.err; fail "data-parallel second writer: exit $rc"; }
wait $first || { cat busy.err; fail "the first writer failed"; }
same busy ref
# Data parallel: rank 0 holds the lock; a SIGKILLed launcher takes its workers along, and with
# them the lock.
ATTNLAB_FAULT_INJECT=checkpoint-sleep-ms=1000 "$BIN" train --quiet --out ddp "${SETS[@]}" --gpus cpu,cpu >/dev/null 2>&1 &
launcher=$!
wait_for "grep -q pid ddp/lock 2>/dev/null" 60
holder=$(pid_in ddp)
tr '\0' '\n' < "/proc/$holder/environ" | grep -qx RANK=0 || fail "the lock holder $holder is not rank 0"
rc=0; train ddp >/dev/null 2>second.err || rc=$?
[ $rc -eq 75 ] && grep -q "pid $holder" second.err || { cat second.err; fail "writer beside a data-parallel job: exit $rc"; }
workers=$(cat "/proc/$launcher/task/$launcher/children")
[ "$(echo $workers | wc -w)" = 2 ] || fail "want 2 workers, found: $workers"
kill -9 $launcher; wait $launcher 2>/dev/null || true
for w in $workers; do wait_for "! alive $w" 15; done
rc=0; train ddp --stop-after 1 >/dev/null 2>&1 || rc=$?
[ $rc -eq 0 ] || fail "the lock outlived the killed data-parallel job (exit $rc)"
echo "   SIGKILL of the data-parallel launcher: workers $workers died with it, the lock with them"
# Readers on a run directory whose lock is held (util-linux flock stands in for a writer).
if command -v flock >/dev/null; then
  mkdir -p readers && cp -r ref readers/run
  # The subshell becomes `sleep`, holding the locked descriptor: killing it releases the lock.
  ( exec 9>readers/run/lock; flock 9; exec sleep 120 ) >/dev/null 2>&1 &
  holder=$!
  wait_for "! flock -n readers/run/lock true" 10
  rc=0; train readers/run >/dev/null 2>&1 || rc=$?
  [ $rc -eq 75 ] || fail "train on a locked (finished) run: exit $rc, want 75"
  "$BIN" eval readers/run >/dev/null 2>&1 || fail "eval needed the lock"
  "$BIN" generate readers/run --prompt "mira lives in" --max-new-tokens 3 >/dev/null 2>&1 || fail "generate needed the lock"
  "$BIN" report readers --out readers/report >/dev/null 2>&1 || fail "report needed the lock"
  kill $holder; wait $holder 2>/dev/null || true
fi

# ------------------------------------------------------------------------------------------------
step "3. a truncated checkpoint falls back to the previous one"
train trunc --stop-after 12 >/dev/null 2>&1
[ -f trunc/checkpoints/8/state.json ] && [ -f trunc/checkpoints/12/state.json ] || fail "want checkpoints 8 and 12"
truncate -s 1000 trunc/checkpoints/12/model.safetensors
train trunc >/dev/null 2>trunc.err || { cat trunc.err; fail "resume past a truncated checkpoint failed"; }
grep -q "checkpoints/12 is corrupt" trunc.err && grep -q "12.corrupt" trunc.err && grep -q "checkpoints/8" trunc.err || { cat trunc.err; fail "the warning does not name both checkpoints"; }
[ "$(stat -c %s trunc/checkpoints/12.corrupt/model.safetensors)" = 1000 ] || fail "the corrupt checkpoint was not kept as 12.corrupt"
same trunc ref
train none --stop-after 8 >/dev/null 2>&1
for c in none/checkpoints/[0-9]*; do truncate -s 10 "$c/optimizer.safetensors"; done
rc=0; train none >/dev/null 2>none.err || rc=$?
[ $rc -ne 0 ] && grep -q "no complete checkpoint left" none.err || { cat none.err; fail "only corrupt checkpoints: exit $rc"; }
[ -d none/checkpoints/4.corrupt ] && [ -d none/checkpoints/8.corrupt ] || fail "corrupt checkpoints not kept"

# ------------------------------------------------------------------------------------------------
step "4. no space left on device"
for fault in enospc-checkpoint=16 enospc-metrics=10; do
  rm -rf full
  rc=0; ATTNLAB_FAULT_INJECT=$fault train full >/dev/null 2>full.err || rc=$?
  [ $rc -ne 0 ] && grep -q "No space left on device" full.err || { cat full.err; fail "$fault: exit $rc, no clear error"; }
  ! compgen -G "full/checkpoints/.tmp-*" >/dev/null || fail "$fault: a .tmp- folder was left behind"
  last=$(ls full/checkpoints | grep -E '^[0-9]+$' | sort -n | tail -1 || true)
  case $fault in
    enospc-checkpoint=16) [ "$last" = 12 ] && grep -q "last complete checkpoint is step 12" full.err || { cat full.err; fail "$fault: last checkpoint $last"; } ;;
    enospc-metrics=10) [ "$last" = 8 ] && grep -q "metrics.jsonl" full.err || { cat full.err; fail "$fault: last checkpoint $last"; } ;;
  esac
  train full >/dev/null 2>&1 || fail "$fault: the re-run failed"
  same full ref
done
# A real full disk: a 3 MB tmpfs in a user namespace, where the kernel allows one. The first
# checkpoint (1.9 MB) fits, the second does not; then the space is freed (remount) and the run
# finishes, bit-identical.
if unshare -rm true 2>/dev/null; then
  mkdir -p tmpfs
  rc=0
  unshare -rm bash -c "
    mount -t tmpfs -o size=3m tmpfs '$WORK/tmpfs' && cd '$WORK/tmpfs' || exit 11
    '$BIN' train --quiet --out run ${SETS[*]} --set data.cache='$WORK/data/cache' >/dev/null 2>'$WORK/tmpfs.err' && exit 10
    ls -a run/checkpoints > '$WORK/tmpfs.ls'
    mount -o remount,size=64m tmpfs '$WORK/tmpfs' || exit 11
    '$BIN' train --quiet --out run ${SETS[*]} --set data.cache='$WORK/data/cache' >/dev/null 2>>'$WORK/tmpfs.err' || exit 12
    cp -r run '$WORK/tmpfs-run'" || rc=$?
  case $rc in
    0) grep -q "No space left on device" tmpfs.err && grep -q "the last complete checkpoint is step 4" tmpfs.err || { cat tmpfs.err; fail "tmpfs: no clear error"; }
       ! grep -q '^\.tmp-' tmpfs.ls || fail "tmpfs: a .tmp- folder was left behind"
       same tmpfs-run ref
       echo "   a full 3 MB tmpfs: clear error, checkpoint 4 kept, finished after freeing space" ;;
    11) echo "   (cannot mount a tmpfs here: real full-disk check skipped; the injected errors above stand in)" ;;
    *) cat tmpfs.err; fail "tmpfs: exit $rc" ;;
  esac
else
  echo "   (no user namespaces: real full-disk check skipped; the injected errors above stand in)"
fi

# ------------------------------------------------------------------------------------------------
step "5. a malformed metrics line is reported"
mkdir -p bad && cp -r ref bad/run
printf '{"step": 3, "lo{"step": 4}\n' >> bad/run/metrics.jsonl
lines=$(wc -l < bad/run/metrics.jsonl)
"$BIN" report bad --out bad/report >/dev/null 2>bad.err || { cat bad.err; fail "report failed"; }
grep -q "bad/run/metrics.jsonl line $lines" bad.err || { cat bad.err; fail "report did not warn about line $lines"; }

# ------------------------------------------------------------------------------------------------
step "6. a sweep killed and relaunched finishes only the missing runs"
cat > sweep.yaml <<EOF
base: $ROOT/experiments/tiny-synthetic.yaml
output: $WORK/sweep-ref
name: "s{train.seed}"
set: {train.steps: $STEPS, train.log_every: 1, checkpoint.every: 4, checkpoint.keep: 2, train.device: cpu, data.seq_len: 64, train.batch_size: 8,
      data.train.synthetic.docs: 300, data.eval.synthetic.synthetic.docs: 40}
grid: {train.seed: [1, 2, 3]}
EOF
"$BIN" sweep sweep.yaml >/dev/null 2>&1 || fail "reference sweep failed"
runs=$(cd sweep-ref && ls -d s*-*)
[ "$(echo "$runs" | wc -l)" = 3 ] || fail "reference sweep: runs $runs"
first_run=$(echo "$runs" | head -1); second_run=$(echo "$runs" | sed -n 2p)
# Slowed down (0.3 s per checkpoint) so that the kills land while a run is in progress.
ATTNLAB_FAULT_INJECT=checkpoint-sleep-ms=300 "$BIN" sweep sweep.yaml --out sweep-kill >/dev/null 2>&1 &
sweep=$!
wait_for "[ -f sweep-kill/$first_run/DONE ] && [ -f sweep-kill/$second_run/checkpoints/4/state.json ]" 120
child=$(pid_in "sweep-kill/$second_run")
kill -9 $sweep; wait $sweep 2>/dev/null || true
wait_for "! alive $child" 10
echo "   SIGKILL of the sweep: its child $child died with it"
ATTNLAB_FAULT_INJECT=checkpoint-sleep-ms=300 "$BIN" sweep sweep.yaml --out sweep-kill >/dev/null 2>sweep.err &
sweep=$!
wait_for "grep -q 'pid' sweep-kill/$second_run/lock && ! grep -q 'pid $child ' sweep-kill/$second_run/lock" 60
child=$(pid_in "sweep-kill/$second_run")
kill -INT $sweep
rc=0; wait $sweep || rc=$?
[ $rc -ne 0 ] && grep -q "stopped by signal 2" sweep.err || { cat sweep.err; fail "SIGINT: sweep exit $rc"; }
! alive $child || fail "SIGINT: the sweep's child $child still runs"
[ ! -f "sweep-kill/$second_run/DONE" ] || fail "SIGINT came too late: $second_run finished"
"$BIN" sweep sweep.yaml --out sweep-kill >sweep.out 2>sweep.err || { cat sweep.err; fail "relaunched sweep failed"; }
grep -q "1 run(s) already done, skipped" sweep.err || { cat sweep.err; fail "the relaunch did not skip the finished run"; }
[ "$(grep -c '== attnlab sweep:' "sweep-kill/$first_run/train.log")" = 1 ] || fail "the finished run was launched again"
for r in $runs; do same "sweep-kill/$r" "sweep-ref/$r"; done
echo "   3 runs bit-identical to the uninterrupted sweep"

step "all fault checks passed"
