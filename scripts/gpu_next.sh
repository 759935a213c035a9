#!/usr/bin/env bash
# The next device call's whole script (docs/perf/cuda.md "Session 28"): exact mode's split
# softmax and word-wise products checked bit for bit on the GPU and timed, and the standing
# figures of the default mode on whatever card serves the call.
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
MODELS=l3b STAGES=models SYNTH_T=16 OUT=$OUT bash scripts/gpu_bench.sh > $OUT/models.txt 2>&1
t models
timeout 90 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick > $OUT/ours.log 2>&1
grep -E "pp512|tg128" $OUT/ours.log; t ours
# conform makes the 1B fixture's model (and runs the suite: fast mode's known shortfall);
# exact: the products at real widths, model_agree's bit-for-bit test on both files, the 1B
# fixture in exact mode, exact mode's speed.
EXACT_MODELS=/tmp/l3b.gguf EXACT_S=90 STAGES=conform,exact OUT=$OUT bash scripts/gpu_bench.sh > $OUT/exact_all.txt 2>&1
grep -E "^test |rows|exact mode|pp512|tg128|aggregate|panicked" $OUT/exact_all.txt | cut -c1-300; t exact
CROSSOVER_CUDA_EXACT=1 timeout 90 .gpu/cuda_bench /tmp/l3b.gguf --depth 512 --profile-only > $OUT/exact_prof.log 2>&1
grep -vE "^\s*$" $OUT/exact_prof.log | head -42 | cut -c1-160; t exact_prof
