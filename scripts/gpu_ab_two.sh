#!/usr/bin/env bash
# Two builds of cuda_bench in one device call, alternating (session 9 lead: the attention K
# operands by ldmatrix): $G/cuda_bench_old (an older build, copied there by hand) and
# $G/cuda_bench (scripts/gpu_prepare.sh's), with the attention kernel tests first.
# TESTS: other kernel test filters; PROFILE= (empty): no --profile; DEPTH4K=0: no depth-4096
# runs (session 10 lead's norm/operand A/B: TESTS="warp_quantized_operands rms_norm_f16_operand
# act_f16_strided swiglu_f16_operand quantize_act_f16 mmk_q4k" PROFILE= DEPTH4K=0).
set -uo pipefail
G=${GPU_DIR:-.gpu-lead}
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s); t() { echo "[$(($(date +%s) - T0)) s] $*"; }
$G/crossover synth --preset llama-3.2-3b --quant q4_k_m --vocab-from $G/ggml-vocab-llama-bpe.gguf \
  -o /tmp/l3b.gguf -q -t 12 >/dev/null 2>&1 &
SYN=$!
$G/crossover synth --preset smollm2-135m --quant q4_1 --layers 2 --byte-vocab -o /tmp/tiny.gguf -q -t 2 >/dev/null 2>&1
timeout 200 $G/cuda_bench_old /tmp/tiny.gguf --depth 64 --par 0 --quick >/dev/null 2>&1 &
W=$!
TESTS=${TESTS:-paged_attention one_token_attention batch_attention_merge attn_decode_merge prefill_attention}
# shellcheck disable=SC2086
timeout 220 $G/kernels --test-threads 1 $TESTS 2>&1 | grep -E "^test |result|panicked"
t "tests done"
wait $W; wait $SYN; t "warm, 3B made"
for r in 1 2; do
  for v in cuda_bench_old cuda_bench; do
    echo "== $v round $r"
    # shellcheck disable=SC2086
    timeout 150 $G/$v /tmp/l3b.gguf --depth 512 --par 16,64 --quick ${PROFILE---profile} 2>&1 \
      | grep -E "^pp512|^tg128|aggregate tg|attn_batch_d4|attn_one_d4|^profile"
  done
done
for v in cuda_bench_old cuda_bench; do
  [[ ${DEPTH4K:-1} == 0 ]] && break
  echo "== $v depth 4096"
  timeout 100 $G/$v /tmp/l3b.gguf --depth 4096 --par 0 --quick 2>&1 | grep -E "^tg128"
done
t done
