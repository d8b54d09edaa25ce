#!/bin/bash
# One device command that checks and times what is pending on an H200 machine, writing every log
# and JSON under $OUT (one tarball plus the benchmarks' own JSON files, within the 8-file limit).
#
#   bash benchmarks/h200_round.sh kernels   # KDA variants, MLA decode variants, MoE tilings (GPU 1 or 0)
#   bash benchmarks/h200_round.sh train     # k3_1b step on one GPU: compile-flag trials, profile
#   bash benchmarks/h200_round.sh both      # both: the kernel runs use the GPU while the steps compile
#   bash benchmarks/h200_round.sh multi     # k3_1b, 50 steps: one GPU, data, expert, context, mixed
#   bash benchmarks/h200_round.sh long      # k3_1b at long context (LONG, LONG_SET): one GPU, split
#   bash benchmarks/h200_round.sh step      # k3_1b's step on one GPU (REMATS: none), profiled
#   bash benchmarks/h200_round.sh peers     # KDA vs jla and fla at the three PERF.md shapes
#   bash benchmarks/h200_round.sh flapeers  # the same with fla first at each shape (a call of its own)
#   bash benchmarks/h200_round.sh kdasweep  # KDA variants and warp counts (ours only); KDA_BASE=DIR
#                                           # also times an earlier commit's copy of the kernels;
#                                           # KDA_SWEEP_S=95: this code's whole op and parts only
#   bash benchmarks/h200_round.sh ncu       # Nsight Compute: our KDA kernels, fwd+bwd
#   bash benchmarks/h200_round.sh glu       # packed SiTU-GLU kernels vs XLA, tile sweep
#   bash benchmarks/h200_round.sh lse       # LM-head log-sum-exp vs XLA, tile sweep (LSE_DTYPE)
#   bash benchmarks/h200_round.sh mladecode # MLA decode kernels (mosaic, seesaw) at N 1-256
#   bash benchmarks/h200_round.sh qbselect  # exact QB's radix select kernel vs XLA
#   bash benchmarks/h200_round.sh states    # issue 40 item 4: the forward with serving's states
#                                           # every 4 chunks against the forward alone
#   bash benchmarks/h200_round.sh kdadecode # KDA decode configurations and copy ceilings, fla
#                                           # (KDA_DECODE_NS=64,256,1024: the pool sizes)
#   bash benchmarks/h200_round.sh conv      # KDA short conv + SiLU kernels vs XLA, tile sweep
#   bash benchmarks/h200_round.sh attnres   # AttnRes mixture kernels vs XLA, tile sweep
#   bash benchmarks/h200_round.sh permute   # MoE permutation kernels (expansion, unpermute) vs XLA
#   bash benchmarks/h200_round.sh optim     # k3_1b's optimizer update alone (ms, bytes vs floor),
#                                           # both Newton-Schulz step forms
#   bash benchmarks/h200_round.sh moesweep  # grouped-matmul tilings, forward, at k3_1b's expert
#                                           # shapes (MOE_SHAPES) beside jla
#   BASE=DIR bash benchmarks/h200_round.sh unchanged  # KDA, MoE and MLA kernels of an earlier
#                                           # commit's copy (`git archive`) and of this code, in
#                                           # turn at the same shapes: a change that must not move them
#   bash benchmarks/h200_round.sh compile1b # k3_1b alone: compile with XLA's pass timers, MFU
#                                           # (COMPILE1B_TRIALS: trials in turn, XLA flags or overrides)
#   bash benchmarks/h200_round.sh amgpu     # the Mosaic kda_chunk_a's card diagnostic (pytest)
#   bash benchmarks/h200_round.sh gates     # issue 40: every gate kind at every shape, jla, fla
#   bash benchmarks/h200_round.sh serving   # issue 39: serve48b, then serve1b (SERVING_S: seconds each)
#   bash benchmarks/h200_round.sh serve48b  # Kimi Linear 48B decode B1-B256, 8K TTFT, prefix hit
#                                           # (an H100: its first 14 of 27 layers)
#   bash benchmarks/h200_round.sh serve1b   # k3_1b's decode B2, B16 (context 64), B64, B256
#                                           # (context 1024), profiled
#   bash benchmarks/h200_round.sh serveflags  # k3_1b's decode B2, B16 with and without XLA's
#                                           # Triton GEMMs (SERVING_S seconds each)
#   bash benchmarks/h200_round.sh startup   # Engine.compile of k3_1b's step shapes (STARTUP_S)
#   bash benchmarks/h200_round.sh long step peers   # several at once (one lock for timed GPU work)
#
# The k3_1b runs compile without XLA's Triton GEMM fusions (85 s instead of 111 s, same step time).
#
# Wheels: `.whl` (fla-core, jax-linear-attention) and `.whl_train` (grain, array-record, portpicker,
# flax, orbax-checkpoint, optax) are carried with the device tool's `carry`. Timed GPU work is
# serialised by one lock file, so compiles (CPU) overlap with measurements without disturbing them
# (`flock -o`: a profiler's leftover child must not inherit the lock).
set -u
LIMIT=${LIMIT:-540}  # seconds for each training-step process (keep under the device call's limit)
R=/tmp/h200_round; mkdir -p "$R"
OUT=${OUT:-$R/out}; mkdir -p "$OUT"
finish() { tar czf "$OUT/h200_round.tar.gz" -C "$R" --exclude='trace*' . 2>/dev/null; }
trap finish EXIT
trap 'exit 143' TERM  # an outer timeout still leaves the tarball (EXIT runs finish)
WHEELS=$(ls .whl/*.whl .whl_train/*.whl .whl_grain/*.whl 2>/dev/null)
[ -z "$WHEELS" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site $WHEELS || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOCK=$R/.gpu.lock
NGPU=$(nvidia-smi -L | grep -c ^GPU)
KGPU=$(( NGPU - 1 ))  # kernels on the last GPU, training steps on GPU 0
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

bench() {
  # One benchmark script on the kernel GPU under the lock: bench NAME SECONDS SCRIPT ARGS...
  local name=$1 secs=$2; shift 2
  flock -o "$LOCK" env CUDA_VISIBLE_DEVICES=$KGPU timeout "$secs" python3 "$@" \
    > "$R/$name.log" 2>&1
  say "$name done"
}

train() {
  # The k3_1b step: default flags, then without XLA's Triton GEMM fusions (compile-time trial).
  CUDA_VISIBLE_DEVICES=0 timeout 420 python3 benchmarks/bench_train.py --config configs/k3_1b.yaml \
    --steps 12 --profile "$R/trace_default" --json "$R/1b_default.json" --lock "$LOCK" \
    > "$R/1b_default.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" timeout 420 \
    python3 benchmarks/bench_train.py --config configs/k3_1b.yaml --steps 12 \
    --json "$R/1b_no_triton_gemm.json" --lock "$LOCK" > "$R/1b_no_triton_gemm.log" 2>&1 &
}

compile1b() {
  # k3_1b's step on one GPU with nothing else running: compile time with XLA's own pass timers
  # (summed by xla_pass_times.py), then 10 steps (MFU). Issue 41's target: under 60 s at the
  # MFU of Training run 50 (35.8%). COMPILE1B_TRIALS: one process per trial, one after the
  # other, ';'-separated, each more XLA flags ('--...') and config overrides ('key=value')
  # ('-' for none; default '-'), e.g. COMPILE1B_TRIALS="-;model.scan_layers=true".
  local i=0 trial word flags sets
  IFS=';' read -ra trials <<< "${COMPILE1B_TRIALS:--}"
  for trial in "${trials[@]}"; do
    flags=""; sets=""
    for word in $trial; do
      case "$word" in -) ;; --*) flags="$flags $word" ;; *) sets="$sets $word" ;; esac
    done
    CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 \
      XLA_FLAGS="--xla_gpu_enable_triton_gemm=false$flags" TF_CPP_MIN_LOG_LEVEL=0 \
      TF_CPP_VMODULE=hlo_pass_pipeline=1,gpu_compiler=1,nvptx_compiler=1 timeout $LIMIT \
      python3 benchmarks/bench_train.py --config configs/k3_1b.yaml --steps 10 $sets \
      --json "$R/1b_compile$i.json" > "$R/1b_compile$i.log" 2> "$R/1b_compile$i.err"
    echo "XLA_FLAGS extra:${flags:- none}; overrides:${sets:- none}" >> "$R/1b_compile$i.log"
    python3 benchmarks/xla_pass_times.py "$R/1b_compile$i.err" > "$R/1b_passes$i.log" 2>&1
    grep -v "hlo_pass_pipeline\|gpu_compiler\|nvptx_compiler" "$R/1b_compile$i.err" | tail -60 \
      > "$R/1b_compile_err_tail$i.log"; rm -f "$R/1b_compile$i.err"
    say "compile1b trial $i done"
    i=$(( i + 1 ))
  done
}

amgpu() {  # the Mosaic kda_chunk_a against float64 at the check's shape: each output's error
  flock -o "$LOCK" timeout 240 python3 -m pytest -p no:xdist -p no:cacheprovider -q \
    tests/test_kda_a_mgpu.py -k matches_float64 -rA > "$R/amgpu.log" 2>&1
  say "amgpu done"
}

gates() {  # issue 40's run: every gate kind at GATE_SHAPES beside jla (fla as the budget allows);
  # GATES_ARGS: more kda.py options (e.g. --shapes, --gate-kinds, --set "chunk_a='bounded'")
  bench kda_gates "${GATES_S:-540}" benchmarks/kda.py --gates --no-profile \
    --budget $(( ${GATES_S:-540} - 25 )) ${GATES_ARGS:-}
}

serving() { serve48b; serve1b; }  # issue 39, what Serving run 13 left (SERVING_S: seconds each)
serve48b() {  # Kimi Linear 48B's decode at B1, 16, 64 and 256 (profiled), then the 8K TTFT and the
  # 7.5K-of-8K prefix hit: the whole model on a card of more than 100 GB (91.5 GiB of bf16
  # weights), else its first 14 of 27 layers (an H100's 80 GB; the floor counts the same layers).
  # SERVE48B_ARGS replaces the run's options; SERVE48B_SET replaces the cut's config overrides;
  # SERVE48B_TAG names the log (serve_48b$TAG.log: a second run in the same call)
  local set="" mb
  mb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "$KGPU")
  [ "$mb" -gt 100000 ] || set="model.num_layers=14 model.mla_layers=[3,7,11,13]"
  flock -o "$LOCK" env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "${SERVING_S:-270}" python3 \
    benchmarks/serve.py --config configs/kimi_linear_48b.yaml \
    ${SERVE48B_ARGS:---batches 1,16,64,256 --ttft 8192 --stream 0 --steps 20 --profile "$R/trace_48b"} \
    ${SERVE48B_SET-$set} > "$R/serve_48b${SERVE48B_TAG:-}.log" 2>&1
  say "serve_48b done"
}
serve1b() {  # k3_1b's decode at B2 and B16 (context 64) and B64 and B256 (context 1024), profiled:
  # whether the B64 and B256 steps still wait on the host now that sampling has no branch
  flock -o "$LOCK" timeout "${SERVING_S:-270}" python3 benchmarks/serve.py \
    --config configs/k3_1b.yaml --only-decode --batches 2,16 --context 64 --steps 20 \
    --profile "$R/trace_serve" > "$R/serve_1b_short.log" 2>&1
  flock -o "$LOCK" timeout "${SERVING_S:-270}" python3 benchmarks/serve.py \
    --config configs/k3_1b.yaml --only-decode --batches 64,256 --context 1024 --steps 20 \
    --profile "$R/trace_serve" > "$R/serve_1b_long.log" 2>&1
  say "serve_1b done"
}
serveflags() {  # k3_1b's decode at B2 and B16 (context 64), profiled, with XLA's Triton GEMM
  # fusions and without (cuBLAS for every product; slower in Serving run 16: 747 kernels against
  # 502 at two rows)
  local flags
  for flags in "" "--xla_gpu_enable_triton_gemm=false"; do
    flock -o "$LOCK" env XLA_FLAGS="$flags" timeout "${SERVING_S:-170}" python3 benchmarks/serve.py \
      --config configs/k3_1b.yaml --only-decode --batches 2,16 --context 64 --steps 30 \
      --profile "$R/trace_flags${flags:+_cublas}" > "$R/serve_flags${flags:+_cublas}.log" 2>&1
  done
  say "serveflags done"
}
startup() {  # Engine.compile of k3_1b's 42 programs (block_size 512, batches to 64) with its
  # progress bar, then decode at B64 and a Poisson stream (32 requests at 4/s, prompts 128-2K,
  # outputs 32-256) that meets no compile; XLA_FLAGS as given (STARTUP_S seconds)
  flock -o "$LOCK" timeout "${STARTUP_S:-400}" python3 benchmarks/serve.py \
    --config configs/k3_1b.yaml --precompile --batches 64 --context 64 --steps 10 --ttft "" \
    --prefix "" --stream 32 --rate 4 > "$R/startup.log" 2>&1
  tr '\r' '\n' < "$R/startup.log" | grep -v "^\s*$" > "$R/startup_lines.log"
  say "startup done"
}

kernels() {  # KDA variants, MLA decode kernels, MoE tilings, one after the other
  bench kda 150 benchmarks/kda.py --sweep --ours-only --no-decode --budget 105
  bench mla 120 benchmarks/mla.py --decode-only --budget 90
  bench moe 150 benchmarks/moe.py --sweep
}

multi() {
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout $LIMIT python3 benchmarks/multi_gpu.py \
    --config configs/k3_1b.yaml --layouts one,data,expert,context,context_experts --steps 50 \
    --out "$R" train.batch_size=8 train.grad_accum=1 > "$R/multi.log" 2>&1
}

long() {
  # Long context, "tokens:layouts" pairs (LONG), each with the overrides in LONG_SET. Measured on
  # 2026-12-01: one H200 holds 512K tokens with LONG_SET="model.remat=full
  # model.kda.save_residuals=false" (99.1 GiB); the 128K context split fits in 54 GiB per GPU.
  # JAX's allocator stops at 75% of the card unless XLA_PYTHON_CLIENT_MEM_FRACTION says more.
  local spec t
  for spec in ${LONG:-131072:context 262144:one,context}; do
    t=${spec%%:*}
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \
      timeout $LIMIT python3 benchmarks/multi_gpu.py \
      --config configs/k3_1b.yaml --layouts ${spec#*:} --steps 4 --tag 1b_$(( t / 1024 ))k \
      --out "$R" train.batch_size=1 train.grad_accum=1 data.seq_len=$t ${LONG_SET:-} > "$R/long_$(( t / 1024 ))k.log" 2>&1 &
  done
}

step() {
  # The one-GPU k3_1b step (the preset: 128 x 4096 as eight micro-batches of 16), profiled, under
  # each remat policy (REMATS, default the preset's none) and each
  # option (STEP_SETS, ';'-separated: '-' for the defaults, else config overrides separated by
  # spaces such as train.loss_chunk=4096), one per GPU in turn (XLA's autotuning while another process compiles would otherwise disturb the
  # timed steps).
  # STEP_BASE=DIR (a copy of an earlier commit, e.g. `git archive`) also times that code's
  # defaults in the same run: the before/after of a change side by side. STEP_HLO=1 also writes
  # each compiled step's HLO text (gzip) beside its log.
  # Do not time it beside `long`, whose compiles autotune on both GPUs.
  local i=0 gpu remat set tag
  if [ -n "${STEP_BASE:-}" ]; then
    (cd "$STEP_BASE" && PYTHONPATH=/tmp/site:$PWD CUDA_VISIBLE_DEVICES=0 \
      XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout $LIMIT python3 \
      benchmarks/bench_train.py --config configs/k3_1b.yaml --steps 12 --lock "$LOCK" \
      --profile "$R/trace_base" --json "$R/1b_base.json" > "$R/1b_base.log" 2>&1) &
    i=1
  fi
  for remat in ${REMATS:-none}; do
    IFS=';' read -ra sets <<< "${STEP_SETS:--}"
    for set in "${sets[@]}"; do
      gpu=$(( i % NGPU )); i=$(( i + 1 ))
      tag=$remat; [ "$set" = "-" ] || tag="${remat}_${set}"; tag=${tag//=/_}; tag=${tag// /+}
      CUDA_VISIBLE_DEVICES=$gpu XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout $LIMIT \
        python3 benchmarks/bench_train.py --config configs/k3_1b.yaml --steps 12 --lock "$LOCK" \
        --profile "$R/trace_$tag" --json "$R/1b_remat_$tag.json" model.remat=$remat \
        ${STEP_HLO:+--hlo "$R/hlo_$tag.txt.gz"} \
        $([ "$set" = "-" ] || echo "$set") \
        > "$R/1b_remat_$tag.log" 2>&1 &
    done
  done
}

peers() {  # KDA vs jla and fla at the PERF.md shapes, fwd and fwd+bwd; fla last (autotuning)
  bench kda_peers "${PEERS_S:-300}" benchmarks/kda.py \
    --shapes 1x16384x32x128,4x4096x32x128,1x65536x16x128 --profile --budget $(( ${PEERS_S:-300} - 20 ))
}

flapeers() {  # fla's autotuning outlasts the budget when it comes last: fla beside ours first.
  # Its autotuning takes minutes per shape: the three shapes outlast one device call (KDA run 41
  # reached two in 570 s), so FLA_SHAPES picks some (run 42: 1x65536x16x128 alone, 360 s).
  bench kda_fla_peers 540 benchmarks/kda.py --fla-first --no-parts --no-decode \
    --shapes "${FLA_SHAPES:-1x16384x32x128,4x4096x32x128,1x65536x16x128}" --budget 520
}

kdasweep() {  # KDA variants and warp counts at B1 T16384 H32 (ours only)
  # KDA_BASE=DIR (a copy of an earlier commit, e.g. `git archive`) first times that code's
  # kernels one by one at the same shape: the before/after of a change in one run.
  # KDA_SWEEP_S: seconds for this code's run (200; below about 100 the sweep itself is skipped
  # and only the whole op and its parts are timed). KDA_SWEEP_SHAPE: another B x T x H x K
  # (e.g. 4x4096x32x128).
  local secs=${KDA_SWEEP_S:-200} shape=${KDA_SWEEP_SHAPE:-1x16384x32x128}
  if [ -n "${KDA_BASE:-}" ]; then
    (cd "$KDA_BASE" && export PYTHONPATH=/tmp/site:$PWD &&
      bench kda_base 120 benchmarks/kda.py --ours-only --no-decode --shapes "$shape" --budget 100)
  fi
  bench kda_sweep "$secs" benchmarks/kda.py --sweep --ours-only --no-decode --shapes "$shape" \
    --budget $(( secs - 30 ))
}

# The step's glue kernels against XLA with their tile sweeps, the decode kernels' configurations
# (KDA: with the pool's in-place copy ceilings; MLA: each kernel in a child process).
glu() { bench glu 60 benchmarks/glu.py --sweep; }
lse() {  # LSE_DTYPE=bfloat16: train.bf16_logits's chunk
  bench logsumexp 60 benchmarks/logsumexp.py --sweep --dtype "${LSE_DTYPE:-float32}"; }
qbselect() { bench radix_select 58 benchmarks/radix_select.py --budget 42; }
states() {  # the forward alone and with the states every 4 chunks at the four shapes of issue 40,
  # the states checked against the float32 recurrence at each (about 60 s a shape)
  bench states 330 benchmarks/kda.py --gates --gate-kinds bounded --ours-only --no-profile \
    --no-parts --no-decode --shapes 1x16384x32x128,4x4096x32x128,1x65536x16x128,1x8192x32x128 \
    --budget 315
}
kdadecode() {  # KDA_DECODE_NS: the pool sizes (default the script's 64,256), e.g. 64,256,1024
  bench kda_decode 200 benchmarks/kda_decode.py --budget 120 --peers \
    ${KDA_DECODE_NS:+--ns $KDA_DECODE_NS}
}
mladecode() { bench mla_decode 150 benchmarks/mla.py --decode-only; }
conv() { bench conv 100 benchmarks/conv.py; }
attnres() { bench attn_res 120 benchmarks/attn_res.py --budget 100; }
permute() { bench moe_permute 80 benchmarks/moe_permute.py --budget 60; }
optim() {  # both Newton-Schulz step forms (optimizer.ns_form), one after the other
  bench optim 240 benchmarks/optim.py configs/k3_1b.yaml --tag sums
  bench optim_poly 240 benchmarks/optim.py configs/k3_1b.yaml optimizer.ns_form=polynomial \
    --tag polynomial
}
moesweep() {  # k3_1b: 48 experts, 8 of them per token at 16 x 4096 (M rounded down to equal
  # groups), latent and expert width 512; the third shape is the gate/up product's d_lhs
  bench moe_sweep "${MOE_S:-200}" benchmarks/moe.py --sweep --no-bwd --budget $(( ${MOE_S:-200} - 60 )) \
    --shapes "${MOE_SHAPES:-48x524160x512x1024,48x524160x512x512,48x524160x1024x512}"
}

unchanged() {  # BASE=DIR: each op's benchmark on that copy, then on this code, one after the other
  local op which dir
  for op in kda moe mla; do
    for which in base this; do
      dir=.; [ $which = this ] || dir=$BASE
      mkdir -p "$R/$which"
      (cd "$dir" && export PYTHONPATH=/tmp/site:$PWD OUT=$R/$which && case $op in
        kda) bench "kda_$which" 100 benchmarks/kda.py --ours-only --no-decode --no-parts \
               --shapes 1x16384x32x128,4x4096x32x128 --budget 60 ;;
        moe) bench "moe_$which" 85 benchmarks/moe.py --quick --no-xla --budget 50 ;;
        mla) bench "mla_$which" 90 benchmarks/mla.py --budget 50 ;;
      esac)
    done
  done
}

ncu() {
  # Hardware counters of our KDA kernels, one forward+backward at B1 T16384 H32 (jla's Mosaic
  # GPU kernels crash the profiler: segmentation fault, 2026-12-01).
  local sec="--section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis"
  flock -o "$LOCK" env CUDA_VISIBLE_DEVICES=$KGPU timeout 200 ncu --clock-control none $sec \
    -k regex:kda_ -c 12 python3 benchmarks/kda_ncu.py ours > "$R/ncu_ours.log" 2>&1
  say "ncu done"
}

[ $# -gt 0 ] || set -- both
for what in "$@"; do  # several modes run side by side; timed GPU work takes the lock in turn
  case "$what" in
    kernels|multi|peers|flapeers|kdasweep|unchanged|ncu|amgpu|gates|serving|serve48b|serve1b|serveflags|startup|glu|lse|states|kdadecode|mladecode|qbselect|conv|attnres|permute|optim|moesweep) $what & ;;  # blocking
    train|long|step|compile1b) $what ;;        # these start background jobs of this shell
    both) train; sleep 5; kernels & ;;
    *) echo "usage: $0 MODE... (the modes are listed at the top of this script)"
       exit 2 ;;
  esac
done
wait
say "all done"
for f in "$R"/*.log; do echo "== $f"; grep -v "^\s*$" "$f" | grep -v "slow_operation\|\*\*\*\|Very slow" | tail -40; done
