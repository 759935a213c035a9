#!/usr/bin/env bash
# The next device call's whole script (docs/perf/cuda.md "Session 33"): the cursor-free SwiGLU
# product (`mvps3`) and the down projection held to 32 registers (`mvqe16`) checked bit for bit
# (kernel tests, then the 3B file's logits) and timed against mvp3 / mvqe; the aligned Q6_K copies' layout-switch test (new in session 32, not yet run);
# Nsight Compute's view of one decode step's kernels on this card; then the H200 A/B of mvp3 and
# mvqe, which sessions 29-31 measured on H100s only. Only 8 files under $OUT come back: the
# greps below print what counts.
# Build machine: NO_LLAMA_SRC=1 bash scripts/gpu_prepare.sh, the NVRTC kernel cache in
# .gpu/kcache (cargo run --release -p cuda --example kernel_cache -- sm_90 with
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
# The file in the background while the kernel tests run (wait on its pid: never pgrep -f).
.gpu/crossover synth --preset llama-3.2-3b --quant q4_k_m --vocab-from .gpu/ggml-vocab-llama-bpe.gguf \
  -o /tmp/l3b.gguf -q -t 12 > $OUT/models.txt 2>&1 &
SYN=$!
timeout 150 .gpu/kernels half_unit_swiglu q6ka_products early_decoded_block --test-threads 1 > $OUT/kernels.log 2>&1
grep -E "^test |test result|panicked" $OUT/kernels.log | cut -c1-200; t kernels
wait $SYN; t "models (rc $?)"
CROSSOVER_CUDA_MODELS=/tmp/l3b.gguf timeout 200 .gpu/model_agree cursor_free_swiglu register_capped_down aligned_q6k \
  --nocapture --test-threads 1 > $OUT/model_agree.log 2>&1
grep -E "rows|largest|test result|panicked" $OUT/model_agree.log | cut -c1-200; t model_agree
timeout 170 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick --ab-mvps --ab-mvqe16 > $OUT/ab_mvps.log 2>&1
grep -E "a/b|pp512|tg128" $OUT/ab_mvps.log | cut -c1-160; t "ab mvps mvqe16"
# Nsight Compute: one depth-0 step's first 20 kernels (two layers), node by node, at the card's
# own clocks; mvps on.
N=/usr/local/cuda/bin/ncu
if [ -x $N ]; then
  CROSSOVER_CUDA_MVPS=1 timeout 130 $N --set full --graph-profiling node --profile-from-start off \
    --clock-control none -c 20 -o /tmp/step --force-overwrite \
    .gpu/cuda_bench /tmp/l3b.gguf --depth 0 --par 0 --quick --ncu 1 > $OUT/ncu_run.log 2>&1
  t "ncu step (rc $?)"
  $N --import /tmp/step.ncu-rep --page details > $OUT/ncu_details.txt 2>&1
  grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" \
    $OUT/ncu_details.txt | cut -c1-120 | head -150
  t "ncu pages"
fi
timeout 150 .gpu/cuda_bench /tmp/l3b.gguf --depth 4096 --par 0 --quick --ab-mvp --ab-mvqe \
  > $OUT/ab_mvp.log 2>&1
grep -E "a/b" $OUT/ab_mvp.log | cut -c1-160; t "ab mvp mvqe"
