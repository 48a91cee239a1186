#!/usr/bin/env bash
# One GPU job: correctness of every fast attention path, the attention-op timings, attnlab's training
# throughput for vanilla / DAR / uniform at Pythia 70M, 160M, 410M, and the Hugging Face peer
# (../shared/bench/hf_pythia_train.py, torch.compile) beside it, and the decode benchmark (`decode`:
# vanilla / DAR / uniform / STILL / LoLCATs caches and speed; DECODE_LENGTHS, DECODE_ATTENTION narrow
# it). Writes logs and JSON lines to $OUT.
# `profile` (not in `all`; about a minute on one H200): where the time of the DAR op and of a DAR
# (and a vanilla, and a split-merge-fused DAR) Pythia-70M training step goes, by kernel under libtorch's profiler
# (`attnlab bench --profile`), summarised by scripts/profile_table.py into $OUT/profile.md,
# where_time_goes.csv, top_kernels.csv and the traces in traces.tar.gz.
# Expects: .gpu/attnlab and .gpu/libattnlab_kernels.so (make gpu-bin), .gpu/data/ for ruler (make gpu-data), .gpu/bench/ (a copy of ../shared/bench: hf_pythia_train.py, attn_peers.py,
# hf_decode.py; not for check, attn, train, profile). Usage:
#   scripts/gpu_bench.sh [check|attn|train|kernels|rms|band|hybrid|hybridvec|hybridfresh|hybridsplit|stacked|decode|ncu|graphs|absorb|fused|ruler|prefill|prefillkernel|kernelsab|pprofile|peers|peers410|profile|dprofile|dtiming|all]...
set -uo pipefail
OUT=${OUT:-/tmp/attnlab-out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH=${TORCH_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/torch/lib}
PY=${PY:-/opt/torch/.venv/bin/python}
A=.gpu/attnlab
# The fused decode step (csrc/cuda/attend_step.cu) in every decode phase unless the caller says 0.
export ATTNLAB_FUSED_STEP=${ATTNLAB_FUSED_STEP:-1}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
run() { echo "+ $*" | tee -a "$OUT/log.txt"; "$@" 2>&1 | tee -a "$OUT/log.txt"; }
# decode_ab VAR TAG FILE: vanilla, STILL (budget) and LoLCATs decode with switch VAR at 0 and at 1,
# interleaved, HYBRID_REPEATS (2) rounds, rows tagged TAG (0 / 1) appended to $OUT/FILE.
decode_ab() {
  local var=$1 tag=$2 file=$3
  for ((r = 0; r < ${HYBRID_REPEATS:-2}; r++)); do
    for v in 0 1; do
      (export "$var=$v"; run $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths ${GRAPH_LENGTHS:-1024,4096,16384,65536} \
        --attention vanilla,still-budget,lolcats --new-tokens 64) | grep '^{' | sed "s/\"repeat\":0/\"repeat\":$r/; s/^{/{\"$tag\":$v,/" >> "$OUT/$file"
    done
  done
}
for what in "${@:-all}"; do
  case $what in
    check|all)
      run $A bench --check --set model.flavor=pythia-70m --set data.train.synthetic.docs=1 --set train.batch_size=2 --set data.seq_len=2048 | tee "$OUT/check.txt" ;;&
    attn|all)
      for T in 2048 4096; do
        run $A bench --attention-only --json --steps 50 --set model.flavor=pythia-70m --set train.batch_size=16 --set data.seq_len=$T --set attention.window=128 | grep '^{' >> "$OUT/attn.jsonl"
      done ;;&
    train|all)
      for size in 70m:64:128 160m:32:192 410m:32:256; do
        IFS=: read -r f b dd <<< "$size"
        for att in "{kind: vanilla}" "{kind: dar, d_down: $dd, window: 128}" "{kind: uniform, d_down: $dd}"; do
          run $A bench experiments/pythia-70m-vanilla.yaml --json --steps 20 --warmup 5 --set model.flavor=pythia-$f \
            --set train.batch_size=$b --set "attention=$att" | grep '^{' >> "$OUT/train.jsonl"
        done
      done ;;&
    kernels)
      # Issue 33: vanilla training with each kernel switch against the defaults (LayerNorm and heads
      # kernels on), interleaved, KERNEL_REPEATS (1) rounds at 70M / 160M / 410M; KERNEL_VARIANTS picks
      # (default "base ce noheads noln": base = the defaults; ce = ATTNLAB_CE_HELD=1, the loss head's
      # rows held in registers; noheads = ATTNLAB_HEADS_KERNEL=0, aten's heads op; noln =
      # ATTNLAB_LN_KERNEL=0, aten's LayerNorm). Rows tagged "variant" in train_kernels.jsonl. Run
      # `check` first (its layer-norm-kernel, heads-op-kernel and loss-head-kernel-held rows).
      for ((r = 0; r < ${KERNEL_REPEATS:-1}; r++)); do
        for size in 70m:64 160m:32 410m:32; do
          IFS=: read -r f b <<< "$size"
          for v in ${KERNEL_VARIANTS:-base ce noheads noln}; do
            heads=1; ce=0; ln=1
            [ $v = noheads ] && heads=0
            [ $v = ce ] && ce=1
            [ $v = noln ] && ln=0
            ATTNLAB_LN_KERNEL=$ln ATTNLAB_HEADS_KERNEL=$heads ATTNLAB_CE_HELD=$ce run $A bench experiments/pythia-70m-vanilla.yaml --json --steps 20 --warmup 5 \
              --set model.flavor=pythia-$f --set train.batch_size=$b --set "attention={kind: vanilla}" | grep '^{' \
              | sed "s/^{/{\"variant\":\"$v\",\"repeat\":$r,/" >> "$OUT/train_kernels.jsonl"
          done
        done
      done ;;
    rms)
      # RMSNorm by the LayerNorm kernels' RMS form (ATTNLAB_RMS_KERNEL=1) against aten's, interleaved,
      # RMS_REPEATS (2) rounds: Llama 30M / 120M and OLMo 2 120M training at T 2048, vanilla and DAR
      # (train_rms.jsonl, rows tagged "rms"). Run `check` first (its rms-norm-kernel rows).
      for ((r = 0; r < ${RMS_REPEATS:-2}; r++)); do
        for size in llama-30m:32 llama-120m:16 olmo2-120m:16; do
          IFS=: read -r f b <<< "$size"
          for att in "{kind: vanilla}" "{kind: dar, d_down: 128, window: 128}"; do
            for k in 0 1; do
              ATTNLAB_RMS_KERNEL=$k run $A bench experiments/pythia-70m-vanilla.yaml --json --steps 20 --warmup 5 --set model.flavor=$f \
                --set train.batch_size=$b --set "attention=$att" | grep '^{' | sed "s/^{/{\"rms\":$k,\"repeat\":$r,/" >> "$OUT/train_rms.jsonl"
            done
          done
        done
      done ;;
    band)
      # Issue 35: DAR training with the local band by csrc/cuda/dar_band.cu (impl split-merge-band)
      # against auto's split-merge-fused, interleaved, BAND_REPEATS (2) rounds at 70M / 160M / 410M
      # (train_band.jsonl, rows tagged "impl"), then a profile of one band step into $OUT/profile_band.md.
      # Run `check` first (its split-merge-band rows).
      for ((r = 0; r < ${BAND_REPEATS:-2}; r++)); do
        for size in 70m:64:128 160m:32:192 410m:32:256; do
          IFS=: read -r f b dd <<< "$size"
          for impl in split-merge-fused split-merge-band; do
            run $A bench experiments/pythia-70m-vanilla.yaml --json --steps 20 --warmup 5 --set model.flavor=pythia-$f --set train.batch_size=$b \
              --set "attention={kind: dar, d_down: $dd, window: 128, impl: $impl}" | grep '^{' | sed "s/^{/{\"impl\":\"$impl\",\"repeat\":$r,/" >> "$OUT/train_band.jsonl"
          done
        done
      done
      P=${PROFILE_DIR:-/tmp/attnlab-profile}/band; rm -rf "$P"; mkdir -p "$P"
      run $A bench experiments/pythia-70m-vanilla.yaml --profile "$P" --steps 3 --warmup 3 --set model.flavor=pythia-70m \
        --set train.batch_size=64 --set "attention={kind: dar, d_down: 128, window: 128, impl: split-merge-band}" \
        && $PY scripts/profile_table.py "$P" > "$OUT/profile_band.md" ;;
    hybrid)
      # Issue 34: STILL (budget) and LoLCATs decode with the mixing kernel (csrc/cuda/hybrid_step.cu, the
      # default) against the aten mix (ATTNLAB_HYBRID_KERNEL=0) (decode_hybrid.jsonl, rows tagged
      # "hybrid_kernel"). Run `check` first.
      decode_ab ATTNLAB_HYBRID_KERNEL hybrid_kernel decode_hybrid.jsonl ;;
    hybridvec)
      # Issue 34: the mixing kernel's 16-byte loads (the default where the rows are aligned) against its
      # scalar ones (ATTNLAB_HYBRID_VEC=0) (decode_hybrid_vec.jsonl, rows tagged "vec"). Run `check`
      # first (its -hybrid-vec rows).
      decode_ab ATTNLAB_HYBRID_VEC vec decode_hybrid_vec.jsonl ;;
    hybridfresh)
      # Issue 34: the mixing kernel writing the new key / value into the window ring itself (the
      # default) against two index_copy kernels before it (ATTNLAB_HYBRID_FRESH=0)
      # (decode_hybrid_fresh.jsonl, rows tagged "fresh"). Run `check` first.
      decode_ab ATTNLAB_HYBRID_FRESH fresh decode_hybrid_fresh.jsonl ;;
    hybridsplit)
      # Issue 34: STILL (budget) and LoLCATs decode with the mixing kernel split over blocks (a head's
      # slots in slices of 64 at once, its linear branch in a block of its own; the default) against one
      # block a head (ATTNLAB_HYBRID_SPLIT=0) (decode_hybrid_split.jsonl, rows tagged "split"). Run
      # `check` first (its -hybrid-one-block rows beside the split ones).
      decode_ab ATTNLAB_HYBRID_SPLIT split decode_hybrid_split.jsonl ;;
    stacked)
      # Issue 34: Llama decode (STILL budget, LoLCATs: hybrid Llamas) with q / k / v_proj and gate /
      # up_proj stacked into one multiply each (src/model/stacked.rs, the default) against separate
      # ones (ATTNLAB_STACKED=0); vanilla (GPT-NeoX, already fused) is the control
      # (decode_stacked.jsonl, rows tagged "stacked").
      decode_ab ATTNLAB_STACKED stacked decode_stacked.jsonl ;;
    decode|all)
      # Issue 29: KV-cache memory, prefill time and decode speed at Pythia-70M size beside Hugging Face
      # GPT-NeoX of the same shape (.gpu/bench/hf_decode.py: eager, and static cache + torch.compile up
      # to 16K) in the same job: DECODE_REPEATS (3) interleaved rounds, each one `attnlab bench-decode`
      # sweep (GPT-NeoX vanilla / DAR / uniform / window; STILL budget m = 384 and LoLCATs hybrid Llamas
      # of the same shape) then one hf_decode.py sweep (its first round compiles; later ones reuse
      # Inductor's cache). Every command runs under what is left of DECODE_BUDGET_S (450 s) and a round
      # starts only with 90 s left, so the phase fits one device call of 9 minutes. Random-init weights
      # and random tokens (speed and memory only). Rows carry `repeat` (the round, from 0) and go to
      # decode.jsonl (attnlab) and decode_peer.jsonl (HF). Render locally with
      #   attnlab bench-decode --from OUT/decode.jsonl --plot results/bench/decode
      DL=${DECODE_LENGTHS:-1024,4096,16384,65536}
      DA=${DECODE_ATTENTION:-vanilla,dar,uniform,window,still-budget,lolcats}
      R=${DECODE_REPEATS:-3}; BUDGET=${DECODE_BUDGET_S:-450}; t0=$SECONDS
      echo "decode: random-init weights and random tokens (cache memory and speed only)" | tee "$OUT/decode-note.txt"
      for ((r = 0; r < R; r++)); do
        left=$((BUDGET - (SECONDS - t0)))
        if ((left < 90)); then echo "decode: rounds $r.. skipped (${left}s of the budget left)" | tee -a "$OUT/log.txt"; break; fi
        run timeout $((left > 30 ? left : 30)) $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths $DL --attention $DA --new-tokens 64 \
          | grep '^{' | sed "s/\"repeat\":0/\"repeat\":$r/" >> "$OUT/decode.jsonl"
        left=$((BUDGET - (SECONDS - t0)))
        (cd .gpu/bench && PYTHONUNBUFFERED=1 run timeout $((left > 30 ? left : 30)) $PY hf_decode.py --lengths $DL --new 64) \
          | grep '^{' | sed "s/^{/{\"repeat\":$r,/" >> "$OUT/decode_peer.jsonl"
      done ;;&
    graphs)
      # Issue 34 item 2: the device-side decode step as CUDA-graph replays vs the same step eager
      # (ATTNLAB_CUDA_GRAPHS=0), GPT-NeoX softmax kinds and the Llama STILL / LoLCATs students,
      # interleaved; equal greedy tokens show as equal tokens_digest per (attention, context).
      GL=${GRAPH_LENGTHS:-1024,4096,16384,65536}
      for ((r = 0; r < ${GRAPH_REPEATS:-2}; r++)); do
        for g in 1 0; do
          ATTNLAB_CUDA_GRAPHS=$g run $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths $GL --attention vanilla,dar,uniform,window,still-budget,lolcats --new-tokens 64 \
            | grep '^{' | sed "s/\"repeat\":0/\"repeat\":$r/" >> "$OUT/decode_graphs$g.jsonl"
        done
      done ;;
    absorb)
      # Issue 34 item 3: DAR / uniform decode reading the latents through the absorbed k / v map vs
      # rebuilding the distant keys and values every step (ATTNLAB_DAR_ABSORB=0), both graphed,
      # interleaved; tokens_digest shows whether bf16 rounding changed a greedy token.
      GL=${GRAPH_LENGTHS:-1024,4096,16384,65536}
      for ((r = 0; r < ${GRAPH_REPEATS:-2}; r++)); do
        for g in 1 0; do
          ATTNLAB_DAR_ABSORB=$g run $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths $GL --attention vanilla,dar,uniform --new-tokens 64 \
            | grep '^{' | sed "s/\"repeat\":0/\"repeat\":$r/" >> "$OUT/decode_absorb$g.jsonl"
        done
      done ;;
    fused)
      # Issue 34 items 2-3: decode through the fused step (csrc/cuda/attend_step.cu; its full-width
      # slots by 16-byte loads, or scalar with ATTNLAB_STEP_SCALAR=1; the latents four slots at a time
      # with ATTNLAB_STEP_BATCHED=1, and without the kr matmul with ATTNLAB_STEP_ROPE=absorbed; `fresh`:
      # absorbed, and the new token written by the combine kernel, ATTNLAB_STEP_FRESH=1; `mma`: the
      # latents on the tensor cores, every head of a chunk in one block, ATTNLAB_STEP_MMA=1, which `1`
      # (the default step) takes from 8,192 latent slots on; `loops`: never, ATTNLAB_STEP_MMA=0;
      # `copied`: the new token written into the caches by index_copy before the step,
      # ATTNLAB_STEP_FRESH=0, where the default hands it over fresh to the combine kernel, which
      # writes it; FUSED_MODES picks, `scalar` too)
      # vs the aten step
      # (ATTNLAB_FUSED_STEP=0: DAR's rebuilt keys below 32K slots, the absorbed read above), all
      # graphed, interleaved: vanilla, window, DAR, uniform.
      GL=${GRAPH_LENGTHS:-1024,4096,16384,65536}
      for ((r = 0; r < ${GRAPH_REPEATS:-2}; r++)); do
        for g in ${FUSED_MODES:-1 batched absorbed fresh 0}; do
          unset ATTNLAB_STEP_SCALAR ATTNLAB_STEP_BATCHED ATTNLAB_STEP_ROPE ATTNLAB_STEP_FRESH ATTNLAB_STEP_MMA
          [ $g = mma ] && export ATTNLAB_STEP_MMA=1
          [ $g = loops ] && export ATTNLAB_STEP_MMA=0
          [ $g = copied ] && export ATTNLAB_STEP_FRESH=0
          [ $g = scalar ] && export ATTNLAB_STEP_SCALAR=1
          [ $g = batched ] && export ATTNLAB_STEP_BATCHED=1
          [ $g = absorbed ] && export ATTNLAB_STEP_ROPE=absorbed
          [ $g = fresh ] && export ATTNLAB_STEP_ROPE=absorbed ATTNLAB_STEP_FRESH=1
          ATTNLAB_FUSED_STEP=$([ $g = 0 ] && echo 0 || echo 1) run $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths $GL --attention vanilla,window,dar,uniform --new-tokens 64 \
            | grep '^{' | sed "s/\"repeat\":0/\"repeat\":$r/" >> "$OUT/decode_fused$g.jsonl"
        done; unset ATTNLAB_STEP_SCALAR ATTNLAB_STEP_BATCHED ATTNLAB_STEP_ROPE ATTNLAB_STEP_FRESH ATTNLAB_STEP_MMA
      done ;;
    ruler)
      # Issue 34 item 4: RULER S-NIAH-1 at 4K, 100 samples, on the Pythia-70M shape (a vanilla model
      # trained one step, so it never stops early: every sample decodes all 128 tokens), with
      # --batch-size 1 and the default, decode steps graphed and eager (ATTNLAB_CUDA_GRAPHS=0).
      # Expects .gpu/data/{gpt-neox-20b.json, valid.jsonl.zst, ruler_paul_graham_essays.json.gz}.
      D=.gpu/data; RR=/tmp/attnlab-ruler-run; rm -rf $RR
      run $A train experiments/pythia-70m-vanilla.yaml --set train.steps=1 --set train.batch_size=2 --set data.seq_len=512 \
        --set data.tokenizer=$D/gpt-neox-20b.json --set "data.train={path: $D/valid.jsonl.zst}" --set "data.eval={}" --set output=$RR >/dev/null
      for g in 1 0; do for bs in 1 default; do
        extra=(); [ $bs = 1 ] && extra=(--batch-size 1)
        rm -f $RR/ruler.json; t0=$(date +%s.%N)
        ATTNLAB_CUDA_GRAPHS=$g run $A eval $RR --task ruler:niah_single_1 --lengths 4096 --samples 100 --essay $D/ruler_paul_graham_essays.json.gz "${extra[@]}" >/dev/null
        t1=$(date +%s.%N)
        # wall_s: the whole command (model load, haystack); seconds: the cell's own (ruler.json).
        $PY - $t0 $t1 $g $bs $RR/ruler.json <<'PYEOF' | tee -a "$OUT/ruler_timing.jsonl"
import json, sys
t0, t1, g, bs, path = sys.argv[1:]
def cells(x):
    if isinstance(x, dict):
        if 'seconds' in x and 'samples' in x: yield x
        for v in x.values(): yield from cells(v)
    elif isinstance(x, list):
        for v in x: yield from cells(v)
c = next(cells(json.load(open(path))))
print(json.dumps({'task': 'ruler:niah_single_1', 'length': c['length'], 'samples': c['samples'], 'batch_size': bs, 'graphs': g == '1',
                  'wall_s': round(float(t1) - float(t0), 3), 'seconds': round(c['seconds'], 3), 'samples_per_s': round(c['samples'] / c['seconds'], 3), 'score': c['score']}))
PYEOF
      done; done ;;
    prefill)
      # Issue 34 item 1: the fixed prefill cost. Two repeats in one process (the second finds every
      # per-shape plan already built) for vanilla / DAR / window, then hf_decode.py once.
      # Hugging Face's prefill is timed after two warm-up calls at the same length: compare with
      # repeat 1 (warm), not repeat 0 (a process's first call at that length).
      PL=${PREFILL_LENGTHS:-1024,4096,16384,65536}
      PA=${PREFILL_ATTENTION:-vanilla,dar,uniform,window,still-budget,lolcats}
      run $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths $PL --attention $PA --new-tokens 16 --repeats 2 \
        | grep '^{' >> "$OUT/prefill.jsonl"
      # The default takes flash below 32K keys and cuDNN from there (attention::PREFILL_CUDNN_FROM);
      # here cuDNN (SDPA / split-merge-cudnn) from 16K on (vanilla, DAR).
      ATTNLAB_PREFILL_SDPA_FROM=16384 run $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths 16384,65536 --attention vanilla,dar \
        --new-tokens 16 --repeats 2 | grep '^{' >> "$OUT/prefill_cudnn.jsonl"
      (cd .gpu/bench && PYTHONUNBUFFERED=1 run $PY hf_decode.py --lengths $PL --new 16) | grep '^{' >> "$OUT/prefill_peer.jsonl" ;;
    prefillkernel)
      # Issue 34: STILL (budget) and LoLCATs prefill by the tensor-core kernels (csrc/cuda/hybrid_prefill.cu:
      # routing scores, softmax over Win ∪ Sel merged with the linear terms; the default) against aten's
      # chunked form (ATTNLAB_HYBRID_PREFILL=0), vanilla the control, PREFILL_REPEATS (2) interleaved
      # rounds at PREFILL_LENGTHS; each row's repeat 1 is warm. Rows tagged "kernel", "round"
      # (prefill_kernel.jsonl). Run `check` first (its prefill-*-kernel rows).
      # PREFILL_SWITCH=ATTNLAB_HYBRID_LINEAR: the linear branch's kernels (csrc/cuda/hybrid_linear.cuh)
      # off / on instead, the other prefill kernels on (rows prefill-*-linear-kernel of `check`);
      # PREFILL_SWITCH=ATTNLAB_LINEAR_TF32: their products by fp32 SIMT tiles / on the tensor cores
      # (rows prefill-*-linear-tf32-kernel; on by default). PREFILL_SWITCH=ATTNLAB_SWIGLU_KERNEL: the
      # Llama MLP's silu(gate)·up by aten's two ops / one kernel (rows silu-mul-kernel; vanilla, a
      # GPT-NeoX, has no SwiGLU: the control).
      for ((r = 0; r < ${PREFILL_REPEATS:-2}; r++)); do
        for v in 0 1; do
          (export "${PREFILL_SWITCH:-ATTNLAB_HYBRID_PREFILL}=$v"; run $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths ${PREFILL_LENGTHS:-1024,4096,16384,65536} \
            --attention vanilla,still-budget,lolcats --new-tokens 4 --repeats 2) | grep '^{' | sed "s/^{/{\"kernel\":$v,\"round\":$r,/" >> "$OUT/prefill_kernel.jsonl"
        done
      done ;;
    kernelsab)
      # Two builds of the kernel library A/B (KERNELS_B, e.g. .gpu/libattnlab_kernels_prewarp.so: the
      # split mixing kernel before its routing score moved to one warp, main 6e4a8c4) against
      # .gpu/libattnlab_kernels.so, STILL (budget) / LoLCATs / vanilla decode, HYBRID_REPEATS (2)
      # interleaved rounds at GRAPH_LENGTHS, rows tagged "lib" (0: the default library, 1: KERNELS_B)
      # in decode_kernels_ab.jsonl. The prewarp library, on the CPU machine:
      #   mkdir -p /tmp/kb && cp csrc/cuda/*.cu csrc/cuda/*.cuh /tmp/kb/ && git show 6e4a8c4:csrc/cuda/hybrid_step.cuh > /tmp/kb/hybrid_step.cuh
      #   then the Makefile's nvcc line with /tmp/kb/*.cu and -o .gpu/libattnlab_kernels_prewarp.so; carry it.
      for ((r = 0; r < ${HYBRID_REPEATS:-2}; r++)); do
        for v in 0 1; do
          lib=.gpu/libattnlab_kernels.so; [ $v = 1 ] && lib=${KERNELS_B:?KERNELS_B names the other library}
          (export ATTNLAB_KERNELS=$lib; run $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths ${GRAPH_LENGTHS:-1024,4096,16384,65536} \
            --attention vanilla,still-budget,lolcats --new-tokens 64) | grep '^{' | sed "s/\"repeat\":0/\"repeat\":$r/; s/^{/{\"lib\":$v,/" >> "$OUT/decode_kernels_ab.jsonl"
        done
      done ;;
    pprofile)
      # Issue 34: where a prefill spends its time (STILL / LoLCATs prefill ≤ vanilla at 16K is not
      # met): each row's prefill under libtorch's profiler (ATTNLAB_PROFILE_PREFILL=1), two repeats
      # in one process at PPROFILE_LENGTHS (16384) for PPROFILE_ATTENTION; the -r1 traces are warm.
      # Summary in $OUT/prefill_profile.md and prefill_top_kernels.csv. The STILL / LoLCATs prefill kernels
      # and their linear branch's by default (ATTNLAB_HYBRID_PREFILL / ATTNLAB_HYBRID_LINEAR=0 turn them off).
      P=${PROFILE_DIR:-/tmp/attnlab-profile}/prefill; rm -rf "$P"; mkdir -p "$P"
      ATTNLAB_PROFILE_PREFILL=1 run $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths ${PPROFILE_LENGTHS:-16384} --new-tokens 2 \
        --repeats 2 --profile "$P" --attention ${PPROFILE_ATTENTION:-vanilla,dar,still-budget,lolcats} | grep '^{' >> "$OUT/prefill_profiled.jsonl"
      $PY scripts/profile_table.py "$P" > "$OUT/prefill_profile.md"
      cp "$P/top_kernels.csv" "$OUT/prefill_top_kernels.csv" ;;
    smprobe)
      # Where split-merge spends its time: w = 1 (global part + merge only) vs w = 128, with and
      # without contiguous cuDNN inputs.
      for c in 0 1; do for w in 1 128; do
        if [ $c = 1 ]; then export ATTNLAB_SM_CONTIG=1; else unset ATTNLAB_SM_CONTIG; fi
        run $A bench --attention-only --json --steps 50 --set model.flavor=pythia-70m --set train.batch_size=16 --set data.seq_len=2048 --set attention.window=$w | grep '^{' | sed "s/^{/{\"contig\":$c,/" >> "$OUT/smprobe.jsonl"
      done; done; unset ATTNLAB_SM_CONTIG ;;
    profile)
      # Traces stay in $P (only 8 files come back from $OUT); the summary and a tarball go to $OUT.
      # Any failure stops the job: a profile that silently lost the GPU would mislead.
      P=${PROFILE_DIR:-/tmp/attnlab-profile}; rm -rf "$P"; mkdir -p "$P"
      DAR="{kind: dar, d_down: 128, window: 128}"
      run $A bench --attention-only --profile "$P" --steps 20 --set model.flavor=pythia-70m --set train.batch_size=16 \
        --set data.seq_len=2048 --set "attention=$DAR" || { echo "profile: op FAILED" | tee -a "$OUT/log.txt"; exit 1; }
      for att in "{kind: vanilla}" "$DAR"; do
        run $A bench experiments/pythia-70m-vanilla.yaml --profile "$P" --steps 3 --warmup 3 --set model.flavor=pythia-70m \
          --set train.batch_size=64 --set "attention=$att" || { echo "profile: step $att FAILED" | tee -a "$OUT/log.txt"; exit 1; }
      done
      # The experimental fused merge (split-merge-fused) in a DAR step, in its own folder.
      run $A bench experiments/pythia-70m-vanilla.yaml --profile "$P/fused" --steps 3 --warmup 3 --set model.flavor=pythia-70m \
        --set train.batch_size=64 --set "attention={kind: dar, d_down: 128, window: 128, impl: split-merge-fused}" \
        || { echo "profile: fused step FAILED" | tee -a "$OUT/log.txt"; exit 1; }
      { $PY scripts/profile_table.py "$P" && echo "## split-merge-fused" && $PY scripts/profile_table.py "$P/fused"; } | tee "$OUT/profile.md"
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "profile: summary FAILED" | tee -a "$OUT/log.txt"; exit 1; }
      cp "$P/where_time_goes.csv" "$P/top_kernels.csv" "$OUT/"
      tar -C "$P" -czf "$OUT/traces.tar.gz" .
      ;;
    dprofile)
      # Issue 34: which kernels a decode step spends its time in, per kind: `bench-decode --profile`
      # (each row's decode steps, graphed as usual, under libtorch's profiler) at DPROFILE_LENGTHS
      # (4096), DPROFILE_ATTENTION kinds; DAR and uniform again with ATTNLAB_STEP_MMA=1 (their own
      # folder). Summary in $OUT/decode_profile.md and decode_top_kernels.csv; rows (slower than
      # unprofiled ones) in decode_profiled.jsonl. A trace without kernels is an error (profiler_stop):
      # if graph replays go untraced on the card, run the phase with ATTNLAB_CUDA_GRAPHS=0.
      P=${PROFILE_DIR:-/tmp/attnlab-profile}/decode; rm -rf "$P"; mkdir -p "$P"
      run $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths ${DPROFILE_LENGTHS:-4096} --new-tokens 32 --profile "$P" \
        --attention ${DPROFILE_ATTENTION:-vanilla,dar,uniform,still-budget,lolcats} | grep '^{' >> "$OUT/decode_profiled.jsonl"
      ATTNLAB_STEP_MMA=1 run $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths ${DPROFILE_LENGTHS:-4096} --new-tokens 32 \
        --profile "$P/mma" --attention dar,uniform | grep '^{' | sed 's/^{/{"mma":1,/' >> "$OUT/decode_profiled.jsonl"
      { $PY scripts/profile_table.py "$P" && echo "## ATTNLAB_STEP_MMA=1" && $PY scripts/profile_table.py "$P/mma"; } > "$OUT/decode_profile.md"
      { cat "$P/top_kernels.csv"; tail -n +2 "$P/mma/top_kernels.csv"; } > "$OUT/decode_top_kernels.csv" ;;
    dtiming)
      # Issue 34: what a decode call's wall time is made of, per kind: DTIMING_TOKENS (64 512) new
      # tokens untimed (their tok/s apart say the per-call cost from the per-step one), then 64 with
      # ATTNLAB_DECODE_TIMING=1 (the first prepare — STILL / LoLCATs make their fixed-shape cache and
      # route a chunk —, the capturing step and the replays, each synced: one line before its row; and
      # the capturing step's parts, warm-up / recorded step / the capture's end, one line a capture).
      # With DTIMING_SWITCH (a kernel switch) both again with it at 0: rows tagged "switch":0 / 1 in
      # decode_tokens.jsonl, the timed lines in decode_timing.txt and decode_timing-off.txt; per-call and
      # per-step costs (scripts/dtiming_table.py) in dtiming.md.
      BD=($A bench-decode experiments/pythia-70m-dar.yaml --json --lengths ${DTIMING_LENGTHS:-1024,4096,16384} --attention ${DTIMING_ATTENTION:-vanilla,dar,still-budget,lolcats})
      SW=${DTIMING_SWITCH:-ATTNLAB_UNUSED}
      for v in 1 ${DTIMING_SWITCH:+0}; do
        for n in ${DTIMING_TOKENS:-64 512}; do
          (export $SW=$v; run "${BD[@]}" --new-tokens $n --repeats ${DTIMING_REPEATS:-2}) | grep '^{' | sed "s/^{/{\"switch\":$v,/" >> "$OUT/decode_tokens.jsonl"
        done
        (export $SW=$v ATTNLAB_DECODE_TIMING=1; run "${BD[@]}" --new-tokens 64) | grep -E '^\{|decode timing|graph capture' > "$OUT/decode_timing$([ $v = 0 ] && echo -off).txt"
      done
      # Per-call and per-step costs from the two numbers of new tokens.
      $PY scripts/dtiming_table.py "$OUT/decode_tokens.jsonl" > "$OUT/dtiming.md" ;;
    ncu)
      # Issue 34: why a decode step's attention kernels take what they take: Nsight Compute's
      # counters (duration, occupancy, warp stall reasons, memory throughput) of the step's own
      # kernels (attend_step.cu's step_*, hybrid_step.cu's) for NCU_ATTENTION (vanilla,dar,uniform) at
      # NCU_LENGTHS (4096,65536), ungraphed, 16 new tokens, one layer's launches after the first token.
      # Clocks left alone (--clock-control none, ../.library/device/METHOD.md). $OUT/ncu_decode.csv,
      # summarised per (kind, length, kernel) in ncu_decode.md by scripts/ncu_table.py.
      : > "$OUT/ncu_decode.csv"
      for att in $(echo ${NCU_ATTENTION:-vanilla,dar,uniform} | tr , ' '); do
        for len in $(echo ${NCU_LENGTHS:-4096,65536} | tr , ' '); do
          echo "== $att $len" >> "$OUT/ncu_decode.csv"
          ATTNLAB_CUDA_GRAPHS=0 run ncu --clock-control none --kernel-name regex:'step_|hybrid' --launch-skip ${NCU_SKIP:-40} --launch-count ${NCU_COUNT:-8} \
            --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
            --csv --page raw $A bench-decode experiments/pythia-70m-dar.yaml --json --lengths $len --attention $att --new-tokens 16 --repeats 1 \
            > "$OUT/ncu-$att-$len.raw" 2>&1
          grep '^"' "$OUT/ncu-$att-$len.raw" >> "$OUT/ncu_decode.csv"; rm -f "$OUT/ncu-$att-$len.raw"
        done
      done
      $PY scripts/ncu_table.py "$OUT/ncu_decode.csv" > "$OUT/ncu_decode.md" 2>&1 ;;
    peers410)
      # Issue 33's 410M ratio on an 80 GB card, where HF's peer at its micro-batch 32 runs out of
      # memory: both at micro-batch PEER410_BATCH (16), vanilla, interleaved, PEER410_REPEATS (2)
      # rounds (train_410m.jsonl, peers_410m.jsonl; a substitute for the 32 of the goal, labelled so).
      pb=${PEER410_BATCH:-16}
      for ((r = 0; r < ${PEER410_REPEATS:-2}; r++)); do
        run $A bench experiments/pythia-70m-vanilla.yaml --json --steps 20 --warmup 5 --set model.flavor=pythia-410m \
          --set train.batch_size=$pb --set "attention={kind: vanilla}" | grep '^{' >> "$OUT/train_410m.jsonl"
        (cd .gpu/bench && PYTHONUNBUFFERED=1 run $PY hf_pythia_train.py --size 410m --batch-size $pb --compile 1 --json) | grep '^{' >> "$OUT/peers_410m.jsonl"
      done ;;
    peers|all)
      for f in 70m 160m 410m; do
        (cd .gpu/bench && PYTHONUNBUFFERED=1 run $PY hf_pythia_train.py --size $f --compile 1 --json) | grep '^{' >> "$OUT/peers.jsonl"
      done
      (cd .gpu/bench && PYTHONUNBUFFERED=1 run $PY attn_peers.py --json-out "$OUT/attn_peers.json") ;;
  esac
done
$PY scripts/bench_table.py "$OUT" | tee "$OUT/table.md"
# The device returns at most 8 files: past that, everything but the table, the gate, the log and the
# card's name goes into rows.tgz (unpack it into results/bench/<date>/).
if (($(ls "$OUT" | wc -l) > 8)); then
  (cd "$OUT" && ls | grep -vxE 'table.md|check.txt|log.txt|gpu.txt' > .packed && tar czf rows.tgz -T .packed && xargs rm -f < .packed && rm .packed)
fi
ls -la "$OUT"
