#!/usr/bin/env bash
# Nsight Compute on one launch of the batched steps' split attention inside the x64 step
# (session 11, docs/perf/cuda.md "Version 13"): `--set full` on the first KERNEL launch after
# SKIP others (default attn_batchw_d4, the 100th: a replayed 64-sequence step of
# `cuda_bench /tmp/l3b.gguf --par 64`), then the details page and the per-instruction SASS page
# (stall samples) as text. Loads the kernel cache made on the build machine ($G/cuda-cache).
set -uo pipefail
G=${GPU_DIR:-.gpu-lead}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/cuda-cache
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
[[ -d $G/cuda-cache ]] && cp "$G"/cuda-cache/* /tmp/cuda-cache/
T0=$(date +%s)
t() { echo "[$(($(date +%s) - T0)) s] $*"; }
[[ -f /tmp/l3b.gguf ]] || $G/crossover synth --preset llama-3.2-3b --quant q4_k_m \
  --vocab-from $G/ggml-vocab-llama-bpe.gguf -o /tmp/l3b.gguf -q -t 12 >/dev/null 2>&1
t "3B file made"
N=/usr/local/cuda/bin/ncu
K=${KERNEL:-attn_batchw_d4}
timeout ${NCU_S:-240} $N --set full --import-source no -k "regex:^$K\$" -s ${SKIP:-100} -c 1 \
  -o "$OUT/attn" --force-overwrite $G/cuda_bench /tmp/l3b.gguf --depth 64 --par 64 --quick \
  >"$OUT/ncu_run.log" 2>&1
t "ncu done (rc $?)"
$N --import "$OUT/attn.ncu-rep" --page details >"$OUT/details.txt" 2>&1
$N --import "$OUT/attn.ncu-rep" --page source --csv --print-source sass >"$OUT/sass.csv" 2>&1
t "pages written"
grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Eligible|Issued Warp|No Eligible|Stall|Warp Cycles Per Issued" "$OUT/details.txt" | head -40
