#!/usr/bin/env bash
# One device call for the batched products on quantized weights (docs/perf/cuda.md, version 8):
# makes the synthetic 3B Q4_K_M file, runs the kernel tests named in TESTS, then cuda_bench's
# aggregates with the f16 products on quantized weights on and off (--ab-mmf, same process)
# and the per-class product timings. Binaries from scripts/gpu_prepare.sh in $GPU_DIR.
set -uo pipefail
G=${GPU_DIR:-.gpu-bat}
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
if [[ -n "${TESTS-matmul_f16w}" ]]; then
  # shellcheck disable=SC2086
  timeout ${TEST_S:-200} $G/kernels --test-threads 1 ${TESTS-matmul_f16w} 2>&1 | tee "$OUT/kernels.log" \
    | grep -E "^test |panicked|seed|error|result"
  t "kernel tests done"
fi
wait $SYN; t "3B file made (rc $?)"
# shellcheck disable=SC2086
timeout ${BENCH_S:-300} $G/cuda_bench /tmp/l3b.gguf --depth ${DEPTH:-512} --par ${PAR:-16,64} --quick \
  ${BENCH_ARGS---profile --ab-mmf} 2>&1 | tee "$OUT/cuda_bench.log"
t "bench done"
if [[ -n "${AGREE:-}" ]]; then
  # shellcheck disable=SC2086
  CROSSOVER_CUDA_MODELS=/tmp/l3b.gguf timeout ${AGREE_S:-120} $G/model_agree --nocapture $AGREE 2>&1 \
    | tee "$OUT/model_agree.log" | grep -E "rows|test result|panicked|SKIPPED|error"
  t "agreement done"
fi
