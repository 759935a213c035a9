#!/usr/bin/env bash
# The next device call's whole script (docs/perf/cuda.md "Session 30"): the early-decoded down
# projection (`mvqe_*`): its kernel test and model-level bit check, then five rounds against
# `mvqp_*` in one process (`cuda_bench --ab-mvqe`); with SKIP=1 also where the step goes
# now (`--ab-skip`).
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
MODELS="smol l3b" STAGES=models SYNTH_T=16 OUT=$OUT bash scripts/gpu_bench.sh > $OUT/models.txt 2>&1
t models
timeout 120 .gpu/kernels --test-threads 1 early_decoded > $OUT/kernels.txt 2>&1
grep -E "^test |^test result|panicked" $OUT/kernels.txt | cut -c1-300; t kernels
CROSSOVER_CUDA_MODELS=/tmp/smol.gguf:/tmp/l3b.gguf timeout 60 .gpu/model_agree --nocapture early_decoded > $OUT/agree.txt 2>&1
grep -E "^test |rows|panicked" $OUT/agree.txt | cut -c1-300; t agree
timeout 150 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick --ab-mvqe > $OUT/ab_mvqe.log 2>&1
grep -E "pp512|tg128|mvq" $OUT/ab_mvqe.log | cut -c1-200; t ab_mvqe
# SKIP=1: also where the step goes now (about 60 s more).
if [ "${SKIP:-0}" = 1 ]; then
  timeout 150 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick --ab-skip > $OUT/ab_skip.log 2>&1
  grep -E "a/b skip" $OUT/ab_skip.log | cut -c1-200; t ab_skip
fi
