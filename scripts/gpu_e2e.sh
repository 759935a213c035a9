#!/usr/bin/env bash
# End-to-end check on the GPU machine (one device call carrying .gpu from scripts/gpu_prepare.sh):
# `crossover run` routes to cuda:0 and to the CPU on request, `audit` of the CUDA backend, and
# `serve` answering over HTTP from the GPU actor with the routing headers, /health and /metrics.
# Usage there: OUT=$OUT bash scripts/gpu_e2e.sh
set -u
G=${GPU_DIR:-.gpu}; export CROSSOVER_CUDA_CACHE=/tmp/cc
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
$G/crossover synth --preset smollm2-135m --quant q4_1 --vocab-from $G/ggml-vocab-starcoder.gguf -o /tmp/smol.gguf -q -t 8 || exit 1
t synth
timeout 60 $G/crossover run --model /tmp/smol.gguf --temp 0 -n 24 "The quick brown fox" 2>&1 | tail -5; t run-default
timeout 60 $G/crossover run --model /tmp/smol.gguf --backend cpu --temp 0 -n 24 "The quick brown fox" 2>&1 | tail -3; t run-cpu
timeout 60 $G/crossover audit --model /tmp/smol.gguf 2>&1 | tail -8; t audit
($G/crossover serve --model /tmp/smol.gguf --port 8093 > $OUT/serve.log 2>&1 &) ; 
for i in $(seq 60); do curl -s localhost:8093/health >/dev/null && break; sleep 1; done; t serve-up
curl -s -D - localhost:8093/v1/chat/completions -H 'content-type: application/json' -d '{"model":"smol","messages":[{"role":"user","content":"hi"}],"max_tokens":16,"stream":true}' | head -8
curl -s -D - localhost:8093/v1/completions -H 'content-type: application/json' -d '{"model":"smol","prompt":"hello","max_tokens":8}' | head -20
curl -s localhost:8093/health; echo
curl -s localhost:8093/metrics | grep -E "^crossover_(requests_total|backend_healthy|kv_blocks_total|tokens_generated)" | head
pkill -TERM -f "crossover serve"; sleep 3; tail -5 $OUT/serve.log; t done
