#!/usr/bin/env bash
# One device call for batch-1 decode (docs/perf/cuda.md, versions 9 to 11): makes the
# synthetic 3B Q4_K_M file in the background while the kernel tests named in TESTS run, then
# cuda_bench's tg128 at depth 0 and $DEPTH with a per-kernel profile and the A/B of
# BENCH_ARGS (default --ab-v10: every variant of v10 in one process; v11 adds --ab-v11 and the
# timing ablation --ab-skip: the step with each kernel class left out), optionally the earlier
# version's cuda_bench ($OLD) and this one's again,
# then (NCU=1, v11) Nsight Compute on the replayed one-token graph at depth 0 and $DEPTH: every
# node's duration (warm caches, clocks left alone) and the whole graph's, then
# the model agreement test on the same file. Binaries from
# scripts/gpu_prepare.sh in $GPU_DIR. Each part runs under its own timeout.
set -uo pipefail
G=${GPU_DIR:-.gpu-dec}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu \
  --format=csv | tee "$OUT/gpu_state.txt"
$G/crossover synth --preset llama-3.2-3b --quant q4_k_m --vocab-from $G/ggml-vocab-llama-bpe.gguf \
  -o /tmp/l3b.gguf -q -t 12 >"$OUT/synth.log" 2>&1 &
SYN=$!
D_TESTS="rms_norm1_and_argmax rms_norm_and_argmax q6_half_and_wave qkv_rope matvec_q prep_products fused_output"
if [[ -n "${TESTS-$D_TESTS}" ]]; then
  # shellcheck disable=SC2086
  timeout ${TEST_S:-100} $G/kernels --test-threads 1 ${TESTS-$D_TESTS} 2>&1 \
    | tee "$OUT/kernels.log" | grep -E "^test |panicked|seed|error|result"
  t "kernel tests done"
fi
wait $SYN; t "3B file made (rc $?)"
# shellcheck disable=SC2086
timeout ${BENCH_S:-60} $G/cuda_bench /tmp/l3b.gguf --depth ${DEPTH:-4096} --par 0 --quick \
  ${BENCH_ARGS---profile --ab-v10} 2>&1 | tee "$OUT/cuda_bench.log" | grep -vE "^kernel |^  "
t "bench done"
if [[ -n "${OLD:-}" ]]; then
  # Before/after in one call: the earlier version's cuda_bench ($G/$OLD, its own kernel compile),
  # then this version's again.
  for b in $OLD cuda_bench; do
    # shellcheck disable=SC2086
    timeout ${OLD_S:-80} $G/$b /tmp/l3b.gguf --depth ${DEPTH:-4096} --par 0 --quick 2>&1 \
      | tee -a "$OUT/ab_versions.log" | grep -E "^tg128|^pp512|^loaded"
    t "$b done"
  done
fi
if [[ -n "${NCU:-}" ]]; then
  # The graph's nodes one by one (serialized: no PDL overlap, no launch gaps), then whole graph
  # replays (the step's own time as ncu sees it); cuda_bench --ncu profiles only the steps
  # between cuProfilerStart and cuProfilerStop.
  N=/usr/local/cuda/bin/ncu
  for mode in node graph; do
    # shellcheck disable=SC2086
    timeout ${NCU_S:-150} $N --graph-profiling $mode --cache-control none --clock-control none \
      --profile-from-start off --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread \
      --csv $G/cuda_bench /tmp/l3b.gguf --depth ${DEPTH:-4096} --par 0 --quick --ncu ${NCU_STEPS:-2} \
      >"$OUT/ncu_$mode.csv" 2>&1
    t "ncu $mode done (rc $?)"; grep -E "^ncu:|ERR|rror" "$OUT/ncu_$mode.csv" | head -8
  done
fi
if [[ -n "${AGREE-gpu_logits_agree}" ]]; then
  # shellcheck disable=SC2086
  CROSSOVER_CUDA_MODELS=/tmp/l3b.gguf timeout ${AGREE_S:-60} $G/model_agree --nocapture ${AGREE-gpu_logits_agree} \
    2>&1 | tee "$OUT/model_agree.log" | grep -E "rows|test result|panicked|SKIPPED|error"
  t "agreement done"
fi
