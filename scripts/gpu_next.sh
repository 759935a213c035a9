#!/usr/bin/env bash
# The next device call's whole script (docs/perf/cuda.md "Session 34"): kernel tests and the 3B
# file's logits for the one-token products (KTESTS, MTESTS), an A/B in one process (AB, default
# `--ab-mvpq`: on an H200 its first measurement), the one-token attention's blocks per SM at
# depth 4096 if ATTN_SWEEP lists them (CROSSOVER_CUDA_ATTN_ONE, one process each; session 34
# ran "1 3 2 4"), then the standing figures, with llama.cpp's llama-bench in the same call when
# .gpu carries its source and LLAMA is not 0 (its CUDA build runs in the background meanwhile).
# Session 34's calls 2-3 ran it with AB=--ab-rope (the rotation angles before the wait,
# removed; its code is in commit 0c2962e); session 35's with AB=--ab-small (AB_SMALL_MODES
# picks the early-launch masks and warp forms alternated). AB_S caps the A/B's seconds (default
# 150). Session 38 ran AB="--ab-mvph --ab-mvpd6 --ab-skip" (both forms removed after it,
# code in commit cbd68b0). Session 40 ran session 39's KTESTS="norm_inside_swiglu
# norm_inside_qkv" MTESTS="norm_inside_swiglu norm_inside_qkv" AB=--ab-norms AB_S=240 (both
# norms inside the launch after them; slower, removed after it, code in commit 8a5cee4). Only
# 8 files under $OUT come back: the greps below print what counts.
# Build machine: bash scripts/gpu_prepare.sh (NO_LLAMA_SRC=1 without llama.cpp), the NVRTC
# kernel cache in .gpu/kcache (cargo run --release -p cuda --example kernel_cache -- sm_90 with
# CROSSOVER_CUDA_CACHE=$PWD/.gpu/kcache and LD_LIBRARY_PATH at the nvidia-cuda-nvrtc wheel's
# lib); to fit 64 MiB, conformance, cuda_trace and the starcoder vocabulary may be left out.
# Device: bash scripts/gpu_next.sh with carry [".gpu"].
set -u
# CARD=H200: run nothing unless the card's name holds it (a call that asks for an H200 may be
# served by an H100, where the standing figures would repeat the last H100 call's).
if [ -n "${CARD:-}" ] && ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "$CARD"; then
  echo "not a $CARD ($(nvidia-smi --query-gpu=name --format=csv,noheader)): nothing run"; exit 0
fi
mkdir -p /tmp/cuda-cache && cp -r .gpu/kcache/. /tmp/cuda-cache/
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
cat $OUT/gpu.txt
if [ -f .gpu/llama-src.tar.gz ]; then LLAMA=${LLAMA:-1}; else LLAMA=${LLAMA:-0}; fi
if [ "$LLAMA" = 1 ]; then
  GPU_DIR=.gpu bash scripts/gpu_llama_build.sh llama-bench > /tmp/llama_build.log 2>&1 &
  BUILD=$!
fi
# The file in the background while the kernel tests run (wait on its pid: never pgrep -f).
.gpu/crossover synth --preset llama-3.2-3b --quant q4_k_m --vocab-from .gpu/ggml-vocab-llama-bpe.gguf \
  -o /tmp/l3b.gguf -q -t $([ "$LLAMA" = 1 ] && echo 4 || echo 12) > /tmp/models.txt 2>&1 &
SYN=$!
timeout 120 .gpu/kernels ${KTESTS:-half_unit_swiglu pipelined_qkv qkv_rope_fused} --test-threads 1 > $OUT/kernels.log 2>&1
grep -E "^test |test result|panicked" $OUT/kernels.log | cut -c1-250; t kernels
wait $SYN; t "models (rc $?)"
CROSSOVER_CUDA_MODELS=/tmp/l3b.gguf timeout 150 .gpu/model_agree ${MTESTS:-pipelined_qkv cursor_free} \
  --nocapture --test-threads 1 > $OUT/model_agree.log 2>&1
grep -E "rows|largest|test result|panicked" $OUT/model_agree.log | cut -c1-200; t model_agree
timeout ${AB_S:-150} .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick ${AB:---ab-mvpq} \
  > $OUT/ab.log 2>&1
grep -E "a/b|pp512|tg128" $OUT/ab.log | grep -v "kernel output\|kernel o \|kernel q" | cut -c1-160; t "ab ${AB:---ab-mvpq}"
# The one-token attention's blocks per SM (splits at 4096: 1 -> 17, 2 -> 33, 3 -> 50, 4 -> 66).
# Only when ATTN_SWEEP is set (each file under $OUT counts against the 8 that come back).
if [ -n "${ATTN_SWEEP:-}" ]; then
  for B in $ATTN_SWEEP; do
    CROSSOVER_CUDA_ATTN_ONE=$B timeout 60 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick \
      > /tmp/attn_$B.log 2>&1
    grep -E "tg128" /tmp/attn_$B.log | sed "s/^/[attn_one=$B] /" | cut -c1-160
  done | tee $OUT/attn_sweep.log; t "attention sweep"
fi
if [ "$LLAMA" = 1 ]; then wait $BUILD; t "llama.cpp build done (rc $?)"; tail -2 /tmp/llama_build.log; fi
# BENCH=0 leaves the standing figures out (a call short of device time).
if [ "${BENCH:-1}" = 1 ]; then
  timeout 90 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --quick --par 4 > $OUT/bench.log 2>&1
  grep -E "pp512|tg128|aggregate" $OUT/bench.log | cut -c1-200; t bench
fi
if [ "$LLAMA" = 1 ]; then
  timeout 150 /tmp/llama/build/bin/llama-bench -m /tmp/l3b.gguf -p 512 -n 128 -fa 1 -ngl 99 -r 3 \
    -d 0,4096 -o md > $OUT/llama_bench.log 2>&1
  grep -E "^\|" $OUT/llama_bench.log; t llama-bench
  timeout 60 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --quick --par 0 > $OUT/bench2.log 2>&1
  grep -E "tg128" $OUT/bench2.log | sed "s/^/[after llama] /" | cut -c1-200; t bench2
fi
