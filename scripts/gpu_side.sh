#!/usr/bin/env bash
# One device call for the side stream's L2 prefetches (session 11, docs/perf/cuda.md "Version
# 13"): loads the kernel cache made on the build machine ($G/cuda-cache, by
# `examples/kernel_cache` with the device's NVRTC, so no ~100 s compile here), makes the
# synthetic SmolLM2-shaped and 3B files, runs model_agree's side test on both (prefetches change
# no logit, every step from a graph), then `cuda_bench --ab-side` on the 3B file: tg128 at depth
# 0 and $DEPTH without / with the one-token prefetches, and the x16 / x64 aggregates without /
# with the wide steps' prefetches, under each launch form of $SIDE_CFGS, alternating in one
# process. AB replaces those cuda_bench flags (session 11's attention loaders: AB=--ab-wp);
# AGREE the model_agree filter (empty: none). Binaries from scripts/gpu_prepare.sh in $GPU_DIR.
# Each part under its own timeout.
set -uo pipefail
G=${GPU_DIR:-.gpu-lead}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/cuda-cache
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
[[ -d $G/cuda-cache ]] && cp "$G"/cuda-cache/* /tmp/cuda-cache/
T0=$(date +%s)
t() { echo "[$(($(date +%s) - T0)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv | tee "$OUT/gpu_state.txt"
$G/crossover synth --preset llama-3.2-3b --quant q4_k_m --vocab-from $G/ggml-vocab-llama-bpe.gguf \
  -o /tmp/l3b.gguf -q -t 12 >"$OUT/synth.log" 2>&1 &
SYN=$!
$G/crossover synth --preset smollm2-135m --quant q4_1 --vocab-from $G/ggml-vocab-starcoder.gguf \
  -o /tmp/smol.gguf -q -t 4 >>"$OUT/synth.log" 2>&1
if [[ -n "${TESTS:-}" ]]; then
  # shellcheck disable=SC2086
  timeout ${TEST_S:-120} $G/kernels --test-threads 1 $TESTS 2>&1 | tee "$OUT/kernels.log" \
    | grep -E "^test |panicked|result"
  t "kernel tests done"
fi
wait $SYN
t "files made"
if [[ -n "${AGREE-side_prefetch}" ]]; then
  # shellcheck disable=SC2086
  CROSSOVER_CUDA_MODELS=/tmp/smol.gguf:/tmp/l3b.gguf timeout ${AGREE_S:-120} $G/model_agree \
    --nocapture ${AGREE-side_prefetch} 2>&1 | tee "$OUT/model_agree.log" \
    | grep -E "rows|test result|panicked|SKIPPED|error"
  t "model_agree done"
fi
# shellcheck disable=SC2086
timeout ${BENCH_S:-300} $G/cuda_bench /tmp/l3b.gguf --depth ${DEPTH:-4096} --par ${PAR:-16,64} \
  --quick ${AB:---ab-side --side-cfgs ${SIDE_CFGS:-0:32:32:16384}} ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/cuda_bench.log" | grep -E "^tg128|^pp512|a/b |aggregate tg|^loaded|attn_|^profile"
t "bench done"
