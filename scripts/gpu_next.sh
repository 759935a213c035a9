#!/usr/bin/env bash
# The next device call's whole script (docs/perf/cuda.md "Session 27", "Next call").
# Build machine: NO_LLAMA_SRC=1 bash scripts/gpu_prepare.sh, then the NVRTC kernel cache into
# .gpu/kcache (cargo run --release -p cuda --example kernel_cache -- sm_90 with
# CROSSOVER_CUDA_CACHE=$PWD/.gpu/kcache and LD_LIBRARY_PATH at the nvidia-cuda-nvrtc wheel's lib).
# Device: bash scripts/gpu_next.sh with carry [".gpu"]; END (default 300) bounds its seconds.
set -u
mkdir -p /tmp/cuda-cache && cp -r .gpu/kcache/. /tmp/cuda-cache/
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s)
E=${END:-300}
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.txt; }
MODELS=l3b STAGES=models SYNTH_T=16 OUT=$OUT bash scripts/gpu_bench.sh > $OUT/models.txt 2>&1
t models
# CROSSOVER_CUDA_ONE_TILES: contexts up to T tiles in one split, longer ones one tile per split.
timeout ${BENCH_T:-100} .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick --ab-tiles > $OUT/tiles.log 2>&1
grep -E "a/b|panicked|error" $OUT/tiles.log; t tiles
# Graph replays of each class of split counts equal eager steps, at T = 1 and 2 (contexts 60-200).
for T in 1 2; do
  CROSSOVER_CUDA_ONE_TILES=$T CROSSOVER_CUDA_MODELS=/tmp/l3b.gguf timeout 60 .gpu/model_agree \
    one_token_split_classes output_projection_quantizing --nocapture --test-threads 1 > $OUT/agree_t$T.log 2>&1
  echo "T=$T"; grep -E "one-token steps|rows;|test result|panicked" $OUT/agree_t$T.log | cut -c1-400; t agree$T
done
# Exact mode's kernels, timed one by one (a 512-token prompt step and a decode step at 512).
CROSSOVER_CUDA_EXACT=1 timeout 90 .gpu/cuda_bench /tmp/l3b.gguf --depth 512 --profile-only > $OUT/exact_prof.log 2>&1
grep -vE "^\s*$" $OUT/exact_prof.log | head -60 | cut -c1-160; t exact_prof
L=$(( E - ($(date +%s) - T0) )); (( L > 150 )) && L=150
(( L > 30 )) && STAGES=tests TEST_S=$L OUT=$OUT bash scripts/gpu_bench.sh > $OUT/tests.txt 2>&1
t tests; grep -cE "\.\.\. ok" $OUT/kernels.log; grep -E "FAILED|panicked" $OUT/kernels.log | head
