#!/usr/bin/env bash
# One device call for the batched (9..64-sequence) steps (docs/perf/cuda.md, version 9): an A/B of
# several cuda_bench builds on the same synthetic 3B Q4_K_M file in one call, alternating, plus
# the kernel tests named in TESTS and optional runs of the newest build under other settings.
#
# $GPU_DIR holds scripts/gpu_prepare.sh's binaries (cuda_bench = the working tree's build) and,
# for the A/B, older builds of examples/cuda_bench as cuda_bench_<name> (e.g. built in a git
# worktree of an earlier commit). VERSIONS lists the names in run order ("cur" = cuda_bench);
# each is run ROUNDS times, alternating. Every binary version compiles its kernels cold once
# (~40 s): a tiny model made first lets each warm its own entry of the shared kernel cache in
# parallel with the 3B synth, so the timed runs all start warm.
# ENVRUNS: extra runs of the current build, e.g. "CROSSOVER_CUDA_AB_CTAS=4 CROSSOVER_CUDA_AB_CTAS=12"
# (one run per word). CUR_ARGS: extra cuda_bench arguments of the current build's runs (e.g.
# "--ab-lt", v10). PROFILE: one more run of the current build with --profile. NCU: a kernel
# name regex for Nsight Compute. AGREE: model_agree test filters, run last on the 3B file.
set -uo pipefail
G=${GPU_DIR:-.gpu-bat}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
T0=$(date +%s)
t() { echo "[$(($(date +%s) - T0)) s] $*"; }
bin() { if [[ $1 == cur ]]; then echo "$G/cuda_bench"; else echo "$G/cuda_bench_$1"; fi; }
VERSIONS=${VERSIONS:-cur}
ROUNDS=${ROUNDS:-2}
BENCH="--depth ${DEPTH:-512} --par ${PAR:-16,64} --quick"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu \
  --format=csv | tee "$OUT/gpu_state.txt"
$G/crossover synth --preset llama-3.2-3b --quant q4_k_m --vocab-from $G/ggml-vocab-llama-bpe.gguf \
  -o /tmp/l3b.gguf -q -t 12 >"$OUT/synth.log" 2>&1 &
SYN=$!
$G/crossover synth --preset smollm2-135m --quant q4_1 --layers 2 --byte-vocab -o /tmp/tiny.gguf -q -t 2 \
  >>"$OUT/synth.log" 2>&1
WARM=()
for v in $VERSIONS; do
  [[ $v == cur && -n "${TESTS:-}" ]] && continue  # the kernel tests warm the current build's entry
  timeout ${WARM_S:-120} "$(bin "$v")" /tmp/tiny.gguf --depth 64 --par 0 --quick >"$OUT/warm_$v.log" 2>&1 &
  WARM+=($!)
done
if [[ -n "${TESTS:-}" ]]; then
  # shellcheck disable=SC2086
  timeout ${TEST_S:-120} $G/kernels --test-threads 1 $TESTS 2>&1 | tee "$OUT/kernels.log" \
    | grep -E "^test |panicked|seed|error|result"
  t "kernel tests done"
fi
for p in "${WARM[@]}"; do wait "$p"; done
t "kernel caches warm"
wait $SYN
t "3B file made (rc $?)"
for r in $(seq 1 "$ROUNDS"); do
  for v in $VERSIONS; do
    echo "=== round $r: $v ===" >>"$OUT/ab.log"
    # shellcheck disable=SC2086
    X=""; [[ $v == cur ]] && X=${CUR_ARGS:-}
    # shellcheck disable=SC2086
    timeout ${RUN_S:-120} "$(bin "$v")" /tmp/l3b.gguf $BENCH $X 2>&1 | tee -a "$OUT/ab.log" \
      | grep -E "aggregate|kernels|pp512|gemm shape"
    t "round $r $v done"
  done
done
for e in ${ENVRUNS:-}; do
  echo "=== $e ===" >>"$OUT/ab.log"
  # shellcheck disable=SC2086
  env "$e" timeout ${RUN_S:-120} $G/cuda_bench /tmp/l3b.gguf $BENCH 2>&1 | tee -a "$OUT/ab.log" \
    | grep -E "aggregate"
  t "$e done"
done
if [[ -n "${PROFILE:-}" ]]; then
  # shellcheck disable=SC2086
  timeout ${RUN_S:-120} $G/cuda_bench /tmp/l3b.gguf $BENCH --profile >"$OUT/profile.log" 2>&1
  t "profile done"
fi
if [[ -n "${AGREE:-}" ]]; then
  # shellcheck disable=SC2086
  CROSSOVER_CUDA_MODELS=/tmp/l3b.gguf timeout ${AGREE_S:-120} $G/model_agree --nocapture $AGREE 2>&1 \
    | tee "$OUT/model_agree.log" | grep -E "rows|test result|panicked|SKIPPED|error"
  t "agreement done"
fi
if [[ -n "${NCU:-}" ]]; then
  # Hardware counters of the first NCU_COUNT launches of the kernels matching $NCU (a regex) in a
  # 64-sequence run (clocks left alone).
  NB=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  timeout ${NCU_S:-60} "${NB:-ncu}" --clock-control none --section SpeedOfLight --section Occupancy \
    --section MemoryWorkloadAnalysis --section LaunchStats -k "regex:$NCU" -c ${NCU_COUNT:-2} \
    $G/cuda_bench /tmp/l3b.gguf --depth 512 --par 64 --quick >"$OUT/ncu.txt" 2>&1
  t "ncu done (rc $?)"
fi
