#!/usr/bin/env bash
# The next device call's whole script (docs/perf/cuda.md "Session 32"): the kernel suite's
# copy tests and the 3B file's logits with and without the aligned Q6_K copies; ours with four
# and with one block a slot (CROSSOVER_CUDA_Q6A_GROUP); on an H200 llama.cpp's llama-bench in
# the same call (its CUDA build runs in the background while the file is made and the tests
# run; the timed runs come after it), then the H200 A/B of mvp3 and mvqe, which sessions 29-31
# measured on H100s only. Only 8 files under $OUT come back: the greps below print what counts.
# Build machine: bash scripts/gpu_prepare.sh (with the llama.cpp source), the NVRTC kernel cache
# in .gpu/kcache (cargo run --release -p cuda --example kernel_cache -- sm_90 with
# CROSSOVER_CUDA_CACHE=$PWD/.gpu/kcache and LD_LIBRARY_PATH at the nvidia-cuda-nvrtc wheel's
# lib); to fit 64 MiB, conformance, cuda_trace and the starcoder vocabulary may be left out.
# Device: bash scripts/gpu_next.sh with carry [".gpu"].
set -u
mkdir -p /tmp/cuda-cache && cp -r .gpu/kcache/. /tmp/cuda-cache/
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $OUT/steps.txt; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv > $OUT/gpu.txt 2>&1
cat $OUT/gpu.txt
# LLAMA=0: no llama.cpp; by default 1 on an H200 (the card) and 0 on others (session 28
# measured llama.cpp on an H100).
if grep -q H200 $OUT/gpu.txt; then LLAMA=${LLAMA:-1}; else LLAMA=${LLAMA:-0}; fi
if [ "$LLAMA" = 1 ]; then
  GPU_DIR=.gpu bash scripts/gpu_llama_build.sh llama-bench > $OUT/llama_build.log 2>&1 &
  BUILD=$!
fi
.gpu/crossover synth --preset llama-3.2-3b --quant q4_k_m --vocab-from .gpu/ggml-vocab-llama-bpe.gguf \
  -o /tmp/l3b.gguf -q -t $([ "$LLAMA" = 1 ] && echo 4 || echo 16) > $OUT/models.txt 2>&1
t models
# The copies' bits: every kernel test that makes one (one and four blocks a slot), and the 3B
# file's logits with and without the copies.
timeout 150 .gpu/kernels q6ka_products qkv_rope_fused staged_products early_decoded_block \
  cluster_product --test-threads 1 > $OUT/kernels.log 2>&1
grep -E "^test |test result|panicked" $OUT/kernels.log | cut -c1-200; t kernels
CROSSOVER_CUDA_MODELS=/tmp/l3b.gguf timeout 150 .gpu/model_agree aligned_q6k --nocapture \
  > $OUT/model_agree.log 2>&1
grep -E "rows|largest|test result|panicked" $OUT/model_agree.log | cut -c1-200; t model_agree
if [ "$LLAMA" = 1 ]; then wait $BUILD; t "llama.cpp build done (rc $?)"; tail -2 $OUT/llama_build.log; fi
ours() {  # $1: blocks a slot, $2: log name, $3: extra cuda_bench arguments
  CROSSOVER_CUDA_Q6A_GROUP=$1 timeout 90 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --quick $3 \
    > $OUT/$2.log 2>&1
  grep -E "pp512|tg128|aggregate" $OUT/$2.log | sed "s/^/[g$1] /" | cut -c1-200; t "$2"
}
ours 4 bench_g4_1 "--par 4"
ours 1 bench_g1_1 "--par 0"
if [ "$LLAMA" = 1 ]; then
  timeout 150 /tmp/llama/build/bin/llama-bench -m /tmp/l3b.gguf -p 512 -n 128 -fa 1 -ngl 99 -r 3 \
    -d 0,4096 -o md > $OUT/llama_bench.log 2>&1
  grep -E "^\|" $OUT/llama_bench.log; t llama-bench
fi
# Session 33's question: do mvp3 and mvqe (both measured on H100s only) gain on this card?
# Five rounds alternating in one process each (session 32: the H200 tree before the
# four-block copies ran 1.237 ms, session 28's before mvp3 and mvqe 1.224).
timeout 120 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick --ab-mvp --ab-mvqe \
  > $OUT/ab_mvp.log 2>&1
grep -E "a/b" $OUT/ab_mvp.log | cut -c1-160; t "ab mvp mvqe"
