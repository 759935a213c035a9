#!/usr/bin/env bash
# The next device call's whole script (docs/perf/cuda.md "Session 29"): the whole kernel suite
# and the pipelined SwiGLU product's model-level bit check, then the product (now the default)
# against the unit kernel in one process, five rounds (`cuda_bench --ab-mvp`), then the standing
# figures with the new default.
# Build machine: NO_LLAMA_SRC=1 bash scripts/gpu_prepare.sh, then the NVRTC kernel cache into
# .gpu/kcache (cargo run --release -p cuda --example kernel_cache -- sm_90 with
# CROSSOVER_CUDA_CACHE=$PWD/.gpu/kcache and LD_LIBRARY_PATH at the nvidia-cuda-nvrtc wheel's lib).
# Device: bash scripts/gpu_next.sh with carry [".gpu"]. Session 30 adds the KV prefetch
# (model_agree kv_prefetch, cuda_bench --ab-kvpf).
set -u
mkdir -p /tmp/cuda-cache && cp -r .gpu/kcache/. /tmp/cuda-cache/
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.txt; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
cat $OUT/gpu.txt
MODELS="smol l3b" STAGES=models SYNTH_T=16 OUT=$OUT bash scripts/gpu_bench.sh > $OUT/models.txt 2>&1
t models
timeout 240 .gpu/kernels --test-threads 1 > $OUT/kernels.txt 2>&1
grep -E "^test result|panicked|FAILED" $OUT/kernels.txt | cut -c1-300; t kernels
CROSSOVER_CUDA_MODELS=/tmp/smol.gguf:/tmp/l3b.gguf timeout 60 .gpu/model_agree --nocapture pipelined_swiglu > $OUT/agree.txt 2>&1
grep -E "^test |rows|panicked" $OUT/agree.txt | cut -c1-300; t agree
timeout 120 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 4 --quick --ab-mvp > $OUT/ab_mvp.log 2>&1
grep -E "pp512|tg128|aggregate" $OUT/ab_mvp.log | cut -c1-200; t ab_mvp
# Session 30: the next layer's KV rows asked of L2 from the main chain (bits, then the A/B).
CROSSOVER_CUDA_MODELS=/tmp/smol.gguf:/tmp/l3b.gguf timeout 90 .gpu/model_agree --nocapture kv_prefetch > $OUT/agree_kvpf.txt 2>&1
grep -E "^test |rows|panicked" $OUT/agree_kvpf.txt | cut -c1-300; t agree_kvpf
timeout 150 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick --ab-kvpf > $OUT/ab_kvpf.log 2>&1
grep -E "a/b|tg128" $OUT/ab_kvpf.log | cut -c1-200; t ab_kvpf
