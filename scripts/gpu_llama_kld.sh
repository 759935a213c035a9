#!/usr/bin/env bash
# llama.cpp against itself, CPU vs CUDA, on the synthetic Llama-3.2-3B Q4_K_M file of
# scripts/gpu_bench.sh: the reference for how far two correct backends' logits agree on a
# random-weight model (docs/perf/cuda.md, "llama.cpp's own CPU vs CUDA"). One device call
# carrying .gpu (scripts/gpu_prepare.sh, with the llama.cpp source): builds llama-perplexity
# with CUDA, saves the CPU backend's logits (no GPU visible) over the repo's docs as text, then
# compares the CUDA backend's (all layers on the GPU, flash attention on) with them:
# llama-perplexity --kl-divergence prints mean KL and "Same top p" (top-1 agreement).
# Usage there: OUT=$OUT bash scripts/gpu_llama_kld.sh
set -uo pipefail
G=${GPU_DIR:-.gpu}; OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
GPU_DIR=$G JOBS=14 bash scripts/gpu_llama_build.sh llama-perplexity >"$OUT/llama_build.log" 2>&1 &
BUILD=$!
$G/crossover synth --preset llama-3.2-3b --quant q4_k_m --vocab-from $G/ggml-vocab-llama-bpe.gguf \
  -o /tmp/l3b.gguf -q -t 2 || { t "synth failed"; exit 1; }
cat README.md docs/*.md docs/perf/*.md > /tmp/text.txt
t "model and text made"
wait $BUILD; rc=$?; t "llama.cpp build rc $rc"; tail -3 "$OUT/llama_build.log"
P=/tmp/llama/build/bin/llama-perplexity
A="-m /tmp/l3b.gguf -f /tmp/text.txt -c 512 --chunks ${CHUNKS:-6} -b 512"
CUDA_VISIBLE_DEVICES= timeout 200 $P $A -ngl 0 -t 14 --kl-divergence-base /tmp/base.kld \
  >"$OUT/kld_cpu.log" 2>&1; t "CPU base rc $?"
timeout 100 $P $A -ngl 99 -fa on --kl-divergence-base /tmp/base.kld --kl-divergence \
  >"$OUT/kld_cuda.log" 2>&1; t "CUDA vs CPU rc $?"
grep -E "Mean +KLD|Same top p|Maximum KLD|^ *99\.0%" "$OUT/kld_cuda.log"
