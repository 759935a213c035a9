#!/usr/bin/env bash
# The next device call's whole script (docs/perf/cuda.md "Session 31"): the standing figures
# with llama.cpp in the same call. llama.cpp's CUDA llama-bench builds in the background while
# the 3B file is made and `cuda_bench --ab-skip` says where the step goes; our cuda_bench runs
# after the build is done (no compile jobs beside it), then llama-bench on the same file, then
# ours again.
# Build machine: bash scripts/gpu_prepare.sh (with the llama.cpp source), the NVRTC kernel cache
# in .gpu/kcache (cargo run --release -p cuda --example kernel_cache -- sm_90 with
# CROSSOVER_CUDA_CACHE=$PWD/.gpu/kcache and LD_LIBRARY_PATH at the nvidia-cuda-nvrtc wheel's
# lib); to fit 64 MiB, model_agree, conformance, cuda_trace and the starcoder vocabulary may be
# left out. Device: bash scripts/gpu_next.sh with carry [".gpu"].
set -u
mkdir -p /tmp/cuda-cache && cp -r .gpu/kcache/. /tmp/cuda-cache/
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.txt; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
cat $OUT/gpu.txt
# LLAMA=0: no llama.cpp (the tests, the A/B and our standing figures only); by default 1 on an
# H200 (the card) and 0 on others (session 28 measured llama.cpp on an H100).
if grep -q H200 $OUT/gpu.txt; then LLAMA=${LLAMA:-1}; else LLAMA=${LLAMA:-0}; fi
if [ "$LLAMA" = 1 ]; then
  GPU_DIR=.gpu bash scripts/gpu_llama_build.sh llama-bench > $OUT/llama_build.log 2>&1 &
  BUILD=$!
fi
.gpu/crossover synth --preset llama-3.2-3b --quant q4_k_m --vocab-from .gpu/ggml-vocab-llama-bpe.gguf \
  -o /tmp/l3b.gguf -q -t $([ "$LLAMA" = 1 ] && echo 4 || echo 16) > $OUT/models.txt 2>&1
t models
# Where the step goes now (SKIP=0 leaves it out; with llama.cpp it runs inside the build's time).
if [ "${SKIP:-1}" = 1 ]; then
  timeout 150 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick --ab-skip > $OUT/ab_skip.log 2>&1
  grep -E "a/b skip" $OUT/ab_skip.log | cut -c1-200; t ab_skip
fi
if [ "$LLAMA" = 1 ]; then wait $BUILD; t "llama.cpp build done (rc $?)"; tail -2 $OUT/llama_build.log; fi
timeout 90 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 4 --quick > $OUT/cuda_bench.log 2>&1
grep -E "pp512|tg128|aggregate|par" $OUT/cuda_bench.log | cut -c1-200; t "our bench"
[ "$LLAMA" = 1 ] || exit 0
timeout 150 /tmp/llama/build/bin/llama-bench -m /tmp/l3b.gguf -p 512 -n 128 -fa 1 -ngl 99 -r 3 \
  -d 0,4096 -o md > $OUT/llama_bench.log 2>&1
cat $OUT/llama_bench.log | grep -E "^\|"; t llama-bench
# Ours again after llama.cpp (the two sides' order both ways within the call), if the call
# has time left.
(( $(date +%s) - T0 < 500 )) || exit 0
timeout 100 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick > $OUT/cuda_bench2.log 2>&1
grep -E "pp512|tg128" $OUT/cuda_bench2.log | cut -c1-200; t "our bench again"
