#!/usr/bin/env bash
# The next device call's whole script (docs/perf/cuda.md "Session 29"): the pipelined half-unit
# products checked bit for bit against their references, then the SwiGLU form's two versions
# timed against the default in one process, five rounds (`cuda_bench --ab-s29`), then the
# 4-sequence and 64-sequence steps with the first version on (it runs only in one-token steps).
# Build machine: NO_LLAMA_SRC=1 bash scripts/gpu_prepare.sh, then the NVRTC kernel cache into
# .gpu/kcache (cargo run --release -p cuda --example kernel_cache -- sm_90 with
# CROSSOVER_CUDA_CACHE=$PWD/.gpu/kcache and LD_LIBRARY_PATH at the nvidia-cuda-nvrtc wheel's lib).
# Device: bash scripts/gpu_next.sh with carry [".gpu"].
set -u
mkdir -p /tmp/cuda-cache && cp -r .gpu/kcache/. /tmp/cuda-cache/
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.txt; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
cat $OUT/gpu.txt
MODELS="l3b" STAGES=models SYNTH_T=16 OUT=$OUT bash scripts/gpu_bench.sh > $OUT/models.txt 2>&1
t models
timeout 90 .gpu/kernels --test-threads 1 half_unit_swiglu pipelined_products > $OUT/kernels.txt 2>&1
grep -E "^test |panicked|assert" $OUT/kernels.txt | cut -c1-300; t kernels
timeout 240 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick --ab-s29 > $OUT/ab_s29.log 2>&1
grep -E "pp512|tg128" $OUT/ab_s29.log | cut -c1-200; t ab_s29
CROSSOVER_CUDA_MVP=1:3 timeout 120 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 4,64 --quick > $OUT/mvp_on.log 2>&1
grep -E "pp512|tg128|aggregate" $OUT/mvp_on.log | cut -c1-200; t mvp_on
