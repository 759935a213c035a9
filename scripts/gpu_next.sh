#!/usr/bin/env bash
# The next device call's whole script (session 26's, not run yet: docs/perf/cuda.md "Session 26").
# Build machine: NO_LLAMA_SRC=1 bash scripts/gpu_prepare.sh, then the NVRTC kernel cache into
# .gpu/kcache (cargo run --release -p cuda --example kernel_cache -- sm_90 with
# CROSSOVER_CUDA_CACHE=$PWD/.gpu/kcache and LD_LIBRARY_PATH at the nvidia-cuda-nvrtc wheel's lib).
# Device: bash scripts/gpu_next.sh with carry [".gpu"]; END (default 585) bounds its seconds.
set -u
mkdir -p /tmp/cuda-cache && cp -r .gpu/kcache/. /tmp/cuda-cache/
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s)
E=${END:-585}
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.txt; }
STAGES=models SYNTH_T=16 OUT=$OUT bash scripts/gpu_bench.sh > $OUT/models.txt 2>&1
t models
timeout 60 .gpu/kernels --test-threads 1 qkv_rope_fused one_token_attention_equals > $OUT/kernels1.log 2>&1
grep -E "^test |panicked|result" $OUT/kernels1.log; t kernels1
timeout ${BENCH_T:-200} .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick --ab-tiles --ab-qkv > $OUT/bench0.log 2>&1
grep -E "pp512|tg128|panicked|error" $OUT/bench0.log; t bench
CROSSOVER_CUDA_MODELS=/tmp/l3b.gguf timeout 60 .gpu/model_agree staged_qkv --nocapture > $OUT/agree_qkv.log 2>&1
grep -E "rows;|test result|panicked" $OUT/agree_qkv.log; t agree_qkv
L=$(( E - 25 - ($(date +%s) - T0) )); (( L > 330 )) && L=330
STAGES=conform,exact EXACT_S=100 OUT=$OUT timeout $L bash scripts/gpu_bench.sh > $OUT/exact.txt 2>&1
t exact; grep -vE "^\s*$" $OUT/exact.txt | tail -40
L=$(( E - ($(date +%s) - T0) )); (( L > 150 )) && L=150
(( L > 30 )) && STAGES=tests TEST_S=$L OUT=$OUT bash scripts/gpu_bench.sh > $OUT/tests.txt 2>&1
t tests; grep -cE "\.\.\. ok" $OUT/kernels.log; grep -E "FAILED|panicked" $OUT/kernels.log | head
