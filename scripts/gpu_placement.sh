#!/usr/bin/env bash
# Host placement on the GPU machine (docs/measure.md, "Host fallback on a GPU"): the test double
# cuda:0-lacking-q6_k and --layers-on-gpu 10 against the all-on-GPU backend.
#
#   scripts/gpu_placement.sh prepare   # build machine: binaries into .cache/place/ (git-ignored)
#   scripts/gpu_placement.sh           # GPU machine (carry .cache/place): results into $OUT
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
P=.cache/place
if [[ "${1:-}" == prepare ]]; then
  set -e
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
  mkdir -p $P
  cargo build --release -p crossover
  exe=$(cargo test --release -p bench --test cuda_placement --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1)
  cp "$CARGO_TARGET_DIR/release/crossover" "$exe" $P/
  mv $P/"$(basename "$exe")" $P/cuda_placement
  strip $P/crossover $P/cuda_placement
  L=${LLAMA_SRC:-/work/cache/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp}
  cp "$L/models/ggml-vocab-starcoder.gguf" $P/
  du -sh $P
  exit 0
fi
OUT=${OUT:-/tmp/place-out}
mkdir -p "$OUT"
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"

# 1. The test: greedy tokens, teacher-forced agreement, graphs off, memory drop.
timeout 150 $P/cuda_placement --nocapture 2>&1 | tee "$OUT/test.log" | grep -E "^test |SKIPPED|matmuls on the host|panicked|result|KL|differ|dropped"
t "test done"

# 2. The CLI end to end on a synthetic SmolLM2 Q4_K_M with a real vocabulary.
$P/crossover synth --preset smollm2-135m --quant q4_k_m --vocab-from $P/ggml-vocab-starcoder.gguf \
  -o /tmp/smolk.gguf -q -t 16
M=/tmp/smolk.gguf
for v in all l10; do
  extra=(); [[ $v == l10 ]] && extra=(--layers-on-gpu 10)
  timeout 30 $P/crossover run -m $M --gpus 0 --no-cpu -n 48 --temp 0 --ignore-eos \
    -p "def fibonacci(n):" "${extra[@]}" >"$OUT/run_$v.txt" 2>"$OUT/run_$v.err"
  echo "run $v: exit $?"; grep "backend cuda" "$OUT/run_$v.err"
done
cmp -s "$OUT/run_all.txt" "$OUT/run_l10.txt" && echo "run: same text with --layers-on-gpu 10" \
  || echo "run: the texts differ"
$P/crossover audit -m $M --backend cuda:0 --layers-on-gpu 10 >"$OUT/audit_l10.txt" 2>&1
echo "audit l10: exit $?"; tail -5 "$OUT/audit_l10.txt"
$P/crossover audit -m $M --backend cuda:0 >"$OUT/audit_all.txt" 2>&1; tail -3 "$OUT/audit_all.txt"
$P/crossover audit -m $M --backend cuda:0-lacking-q6_k --strict >"$OUT/audit_q6k.txt" 2>&1
echo "audit q6k --strict: exit $?"; tail -6 "$OUT/audit_q6k.txt"
t "cli done"
for v in all l10; do
  extra=(); [[ $v == l10 ]] && extra=(--layers-on-gpu 10)
  timeout 60 $P/crossover bench -m $M --gpus 0 --no-cpu --no-builtin --workload prompt=512,gen=64 \
    --runs 3 --warmup 1 "${extra[@]}" >"$OUT/bench_$v.txt" 2>"$OUT/bench_$v.err"
  echo "bench $v: exit $?"; cat "$OUT/bench_$v.txt"
done
# 3. A Llama-3.2-1B-shaped Q4_K_M: half its layers on the host.
$P/crossover synth --preset llama-3.2-1b --quant q4_k_m --vocab-from $P/ggml-vocab-starcoder.gguf \
  -o /tmp/l1b.gguf -q -t 16
for v in all l8; do
  extra=(); [[ $v == l8 ]] && extra=(--layers-on-gpu 8)
  $P/crossover audit -m /tmp/l1b.gguf --backend cuda:0 "${extra[@]}" >"$OUT/audit1b_$v.txt" 2>&1
  tail -4 "$OUT/audit1b_$v.txt" | grep -v "^-"
  timeout 60 $P/crossover bench -m /tmp/l1b.gguf --gpus 0 --no-cpu --no-builtin \
    --workload prompt=512,gen=64 --runs 3 --warmup 1 "${extra[@]}" >"$OUT/bench1b_$v.txt" 2>/dev/null
  echo "bench 1b $v: exit $?"; sed -n 3p "$OUT/bench1b_$v.txt"
done
t "all done"
