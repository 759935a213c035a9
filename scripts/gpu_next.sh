#!/usr/bin/env bash
# The next device call's whole script (docs/perf/cuda.md "Session 28"): llama.cpp's CUDA build
# and ours side by side on the same card, with exact mode's new integer pass.
# Build machine: bash scripts/gpu_prepare.sh (with the llama.cpp source), then the NVRTC kernel
# cache into .gpu/kcache (cargo run --release -p cuda --example kernel_cache -- sm_90 with
# CROSSOVER_CUDA_CACHE=$PWD/.gpu/kcache and LD_LIBRARY_PATH at the nvidia-cuda-nvrtc wheel's
# lib); under the 64 MiB a call carries only without .gpu/{model_agree,kernels,cuda_trace}.
# Device: bash scripts/gpu_next.sh with carry [".gpu"].
set -u
mkdir -p /tmp/cuda-cache && cp -r .gpu/kcache/. /tmp/cuda-cache/
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.txt; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
cat $OUT/gpu.txt
JOBS=14 GPU_DIR=.gpu bash scripts/gpu_llama_build.sh llama-bench > $OUT/llama_build.log 2>&1 &
BUILD=$!
MODELS=l3b STAGES=models SYNTH_T=2 OUT=$OUT bash scripts/gpu_bench.sh > $OUT/models.txt 2>&1
t models
# The conformance suite on the synthetic 1B fixture, fast and exact mode.
STAGES=conform OUT=$OUT bash scripts/gpu_bench.sh > $OUT/conform.txt 2>&1
grep -E "^test |rows|panicked" $OUT/conformance.log | cut -c1-300; t conform
# Exact mode's speed and kernel profile with the word-wise integer pass (session 28).
CROSSOVER_CUDA_EXACT=1 timeout 100 .gpu/cuda_bench /tmp/l3b.gguf --depth 512 --par 0 --quick > $OUT/exact_bench.log 2>&1
grep -E "pp512|tg128|panicked|error" $OUT/exact_bench.log; t exact_bench
CROSSOVER_CUDA_EXACT=1 timeout 90 .gpu/cuda_bench /tmp/l3b.gguf --depth 512 --profile-only > $OUT/exact_prof.log 2>&1
grep -vE "^\s*$" $OUT/exact_prof.log | head -40 | cut -c1-160; t exact_prof
wait $BUILD; t "llama.cpp build rc $?"; tail -2 $OUT/llama_build.log
# Side by side: ours, llama.cpp, ours (same file, same card).
timeout 80 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick > $OUT/ours1.log 2>&1
grep -E "pp512|tg128" $OUT/ours1.log; t ours1
L=$(( 570 - ($(date +%s) - T0) )); (( L > 150 )) && L=150
(( L > 20 )) && timeout $L /tmp/llama/build/bin/llama-bench -m /tmp/l3b.gguf -p 512 -n 128 -fa 1 -ngl 99 -r 3 \
  -d 0,4096 -o md > $OUT/llama_bench.log 2>&1
cat $OUT/llama_bench.log | grep -E "^\|"; t llama
L=$(( 590 - ($(date +%s) - T0) )); (( L > 80 )) && L=80
(( L > 20 )) && timeout $L .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick > $OUT/ours2.log 2>&1
grep -E "pp512|tg128" $OUT/ours2.log; t ours2
