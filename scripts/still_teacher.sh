# The llama-30m needle teacher on the GPU host, shared by gpu_still_ablation.sh and
# gpu_still_diagnose.sh (sourced). Needs A (binary), D (data folder), T (run dir), ESSAY, LOG and log().
teacher() {
  if [ -f $T/DONE ]; then log "teacher present"; return; fi
  local t0=$(date +%s)
  $A train experiments/llama-30m-needle-teacher.yaml --quiet --out $T \
    --set data.tokenizer=$D/gpt-neox-20b.json --set data.cache=/tmp/cache \
    --set "data.train.mix=[{path: $D/train-00.jsonl.zst}, {path: $D/train-01.jsonl.zst}, {needles: {tasks: [niah_single_1, niah_single_2, niah_single_3, niah_multikey_1], docs: 30000, min_words: 60, max_words: 700, essay: $ESSAY}}]" \
    --set "data.eval={valid: {path: $D/valid.jsonl.zst}}" --set train.steps=${TEACHER_STEPS:-5000} 2>&1 | tail -3 | tee -a "$LOG"
  log "teacher trained in $(( $(date +%s) - t0 )) s"
}
