#!/usr/bin/env bash
# On the GPU machine: unpacks the llama.cpp source subset that scripts/gpu_prepare.sh put in
# $GPU_DIR (default .gpu) into /tmp/llama and builds its CUDA variant for the H200 (sm_90), only
# the targets named: `bash scripts/gpu_llama_build.sh llama-bench llama-batched-bench`.
# Shared by scripts/gpu_bench.sh and scripts/gpu_llama_kld.sh. JOBS (default 12) compile jobs.
set -euo pipefail
G=${GPU_DIR:-.gpu}
[[ $# -gt 0 ]] || { echo "usage: $0 TARGET..." >&2; exit 2; }
targets=()
for t in "$@"; do targets+=(--target "$t"); done
mkdir -p /tmp/llama
tar xzf "$G/llama-src.tar.gz" -C /tmp/llama
cd /tmp/llama
cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"${JOBS:-12}" "${targets[@]}"
