#!/usr/bin/env bash
# Session 10 lead: where the mmk kernel's time goes (ncu on one 3072x3072 x64 launch) and its
# plan variants on a 2-layer 3B-shaped file.
set -uo pipefail
G=${GPU_DIR:-.gpu-lead}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s); t() { echo "[$(($(date +%s) - T0)) s] $*"; }
$G/crossover synth --preset llama-3.2-3b --quant q4_k_m --layers 2 --vocab-from $G/ggml-vocab-llama-bpe.gguf \
  -o /tmp/l2.gguf -q -t 12 >"$OUT/synth.log" 2>&1 &
NB=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
timeout 300 "$NB" --set full -k regex:mmk_q4_k_8 --launch-skip 15 -c 1 $G/kernels --test-threads 1 mmk_q4k \
  >"$OUT/ncu_mmk.txt" 2>&1
t "ncu rc $?"
wait
for v in "X=0" "CROSSOVER_CUDA_MMK_SLICES=1" "CROSSOVER_CUDA_MMK_SLICES=2" "CROSSOVER_CUDA_MMK_WARPS=4"; do
  echo "=== $v ===" >>"$OUT/variants.log"
  env "$v" timeout 90 $G/cuda_bench /tmp/l2.gguf --depth 512 --par 64 --quick --ab-mmk >>"$OUT/variants.log" 2>&1
  t "$v rc $?"
done
grep -E "===|batched product|aggregate" "$OUT/variants.log"
