#!/usr/bin/env bash
# One bench run on the GPU machine (docs/measure.md): a synthetic SmolLM2-135M Q4_1 (the vocab of
# SmolLM2, random weights of the same shapes), then the built-in workloads on every backend.
# Prepare on the build machine:
#   mkdir -p .cache/measure-gpu && cp target/release/crossover .cache/measure-gpu/ &&
#   strip .cache/measure-gpu/crossover && cp .cache/vocab/ggml-vocab-starcoder.gguf .cache/measure-gpu/
# then run this script there with .cache/measure-gpu carried along; results go to $OUT.
set -uo pipefail
D=${D:-.cache/measure-gpu}
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,power.draw,power.limit --format=csv | tee "$OUT/gpu.txt"
ls /sys/class/powercap 2>&1 | tee "$OUT/powercap.txt"
$D/crossover synth --preset smollm2-135m --quant q4_1 --vocab-from $D/ggml-vocab-starcoder.gguf -o /tmp/smol.gguf -q -t 8 2>&1 | tail -2
date -u +%FT%TZ > "$OUT/start"
$D/crossover bench --model /tmp/smol.gguf --runs ${RUNS:-5} --warmup 2 --plot "$OUT/bench.svg" > "$OUT/table.txt" 2> "$OUT/bench.err"
echo "rc=$?" >> "$OUT/bench.err"
date -u +%FT%TZ > "$OUT/end"
cat "$OUT/table.txt"; tail -5 "$OUT/bench.err"
