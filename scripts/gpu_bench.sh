#!/usr/bin/env bash
# One run on the GPU machine (see docs/perf/cuda.md): builds llama.cpp's CUDA llama-bench and
# llama-batched-bench (scripts/gpu_llama_build.sh) in the
# background, makes the synthetic models there, runs the CUDA kernel tests, benchmarks our
# backend, runs the CPU-vs-GPU agreement tests, then llama-bench on the same file. Results go
# to $OUT.
#
# Expects in .gpu/ (prepared on the build machine by scripts/gpu_prepare.sh): crossover,
# kernels, model_agree, cuda_bench (stripped), llama-src.tar.gz (llama.cpp source subset from the
# llama-cpp-python 0.3.36 sdist), ggml-vocab-starcoder.gguf, ggml-vocab-llama-bpe.gguf.
#
# STAGES (default build,models,tests,bench,agree,llama; also trace, conform, exact, ab, sample, prof) picks stages; the agreement tests run
# while llama.cpp builds, bounded by DEADLINE (seconds from start, default 420) so that
# llama-bench still fits in a 600 s device call. BENCH_ARGS go to cuda_bench (e.g. --quick). AGREE lists the agreement runs as FILE:GEMM_MIN
# (steps of more than GEMM_MIN tokens take cuBLAS); BENCH_S bounds cuda_bench (default 200 s), TEST_S the kernel tests (240 s).
set -uo pipefail
G=${GPU_DIR:-.gpu}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export CROSSOVER_CUDA_CACHE=/tmp/cuda-cache
STAGES=${STAGES:-build,models,tests,bench,agree,llama}
DEADLINE=${DEADLINE:-420}
AGREE=${AGREE:-/tmp/smol.gguf:8 /tmp/smol.gguf:64 /tmp/l3b.gguf:8}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
T0=$(date +%s)
t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv | tee "$OUT/gpu_state.txt"

BUILD=
if has build; then
  GPU_DIR=$G bash scripts/gpu_llama_build.sh llama-bench llama-batched-bench >"$OUT/llama_build.log" 2>&1 &
  BUILD=$!
  t "llama.cpp build started"
fi

if has models; then
  # MODELS (default "smol l3b") picks the files; SYNTH_T threads (4 leave cores to the build).
  if [[ " ${MODELS:-smol l3b} " == *" smol "* ]]; then
    $G/crossover synth --preset smollm2-135m --quant q4_1 --vocab-from $G/ggml-vocab-starcoder.gguf \
      -o /tmp/smol.gguf -q -t ${SYNTH_T:-4} || t "synth smollm2 failed"
  fi
  if [[ " ${MODELS:-smol l3b} " == *" l3b "* ]]; then
    $G/crossover synth --preset llama-3.2-3b --quant q4_k_m --vocab-from $G/ggml-vocab-llama-bpe.gguf \
      -o /tmp/l3b.gguf -q -t ${SYNTH_T:-4} || t "synth 3b failed"
  fi
  ls -la /tmp/*.gguf
  t "models made"
fi

if has conform; then
  # The CPU's conformance suite (llama.cpp's logits) on the GPU: the synthetic 1B fixture's model
  # is made here by the fixture's own command (its sha256 is checked by the test).
  mkdir -p /tmp/cc/vocab/templates .cache/models && cp $G/ggml-vocab-llama-bpe.gguf /tmp/cc/vocab/ &&
    cp $G/templates/* /tmp/cc/vocab/templates/
  CROSSOVER_CACHE=/tmp/cc $G/crossover synth --preset llama-3.2-1b --quant q4_k_m --seed 1 -q -t 8 \
    -o .cache/models/synth-llama-3.2-1b-q4_k_m-s1.gguf || t "synth 1b failed"
  timeout 120 $G/conformance --nocapture --test-threads 1 2>&1 | tee "$OUT/conformance.log" \
    | grep -E "^test |rows|panicked|SKIPPED"
  t "conformance done"
fi

if has exact; then
  # Exact mode (crates/cuda/src/exact.rs): the GPU's logits against the CPU backend's, bit for bit,
  # on the models made above (EXACT_MODELS, default both), then llama.cpp's fixture logits on the
  # synthetic 1B (made by the conform stage, which must run first), and exact mode's speed.
  # The products at real widths first (kernels exact_products_on_the_gpu_equal_the_cpu_products).
  timeout 60 $G/kernels exact_products_on_the_gpu --nocapture 2>&1 | tee -a "$OUT/exact.log" \
    | grep -E "^test |differ|panicked"
  for m in ${EXACT_MODELS:-/tmp/smol.gguf /tmp/l3b.gguf}; do
    L1=$OUT/exact_$(basename "$m").log
    CROSSOVER_CUDA_MODELS=$m timeout ${EXACT_S:-150} $G/model_agree exact_mode_logits --nocapture >"$L1" 2>&1
    cat "$L1" >>"$OUT/exact.log"
    grep -E "exact mode|test result|panicked|SKIPPED|seed" "$L1"
    # Where the GPU parts from the host build of the same kernels, layer by layer (only
    # when this file's CPU comparison failed).
    if grep -q "exact-mode rows differ" "$L1"; then
      CROSSOVER_CUDA_MODELS=$m timeout 120 $G/model_agree exact_mode_equals_its_host --nocapture 2>&1 \
        | tee -a "$OUT/exact.log" | grep -E "layers:|test result|panicked"
    fi
  done
  [[ -f .cache/models/synth-llama-3.2-1b-q4_k_m-s1.gguf ]] &&
    timeout 120 $G/conformance exact_mode_gives_llama_cpps_logits_on_synth_llama_1b --nocapture 2>&1 \
      | tee -a "$OUT/exact.log" | grep -E "^test |rows|panicked|SKIPPED"
  CROSSOVER_CUDA_EXACT=1 timeout 120 $G/cuda_bench /tmp/l3b.gguf --depth 512 --par 4 --quick 2>&1 \
    | tee "$OUT/exact_bench.log" | grep -E "pp512|tg128|aggregate|panicked|error"
  t "exact mode done"
fi

if has trace; then
  # Op-by-op GPU vs CPU on the 3B file, and the CPU against itself (examples/cuda_trace.rs).
  timeout 200 $G/cuda_trace /tmp/l3b.gguf --tokens ${TRACE_N:-64} 2>&1 | tee "$OUT/trace.log"
  t "trace done"
fi

if has tests; then
  timeout ${TEST_S:-240} $G/kernels --test-threads 1 2>&1 | tee "$OUT/kernels.log" | grep -E "^test |panicked|seed|error"
  t "kernel tests done"
fi

if has ab; then
  # Quick A/B of this version's defaults against other kernel choices, same binary, same file:
  # AB_ENV holds the other side's environment (default: the split-K CUDA-core prefill attention).
  timeout 90 $G/cuda_bench /tmp/l3b.gguf --depth 4096 --par ${PAR:-4} --quick 2>&1 | tee "$OUT/ab_new.log"
  env ${AB_ENV:-CROSSOVER_CUDA_PREFILL_MMA=0} timeout 90 $G/cuda_bench /tmp/l3b.gguf \
    --depth 4096 --par ${PAR:-4} --quick 2>&1 | tee "$OUT/ab_old.log"
  t "a/b done"
fi

if has sample; then
  # Sampled decoding through the actor (temperature 0.8, top-k 40, no penalties) on the 3B file:
  # the device's top-k lists (CROSSOVER_CUDA_TOPK=1, Gpu::top_k_rows) against each whole row
  # copied to the host (0), alternating, three rounds; the same seed must give the same text.
  for round in 1 2 3; do
    for k in 0 1; do
      CROSSOVER_CUDA_TOPK=$k timeout 60 $G/crossover run --model /tmp/l3b.gguf --backend cuda:0 \
        --temp 0.8 --top-k 40 --repeat-penalty 1 --seed 7 --ignore-eos -n 256 "The history of" \
        >"$OUT/sample_${k}_${round}.txt" 2>"$OUT/sample_${k}_${round}.err"
      echo "CROSSOVER_CUDA_TOPK=$k round $round: $(grep -E '^prompt:' "$OUT/sample_${k}_${round}.err")"
    done
  done | tee "$OUT/sample.log"
  if cmp -s "$OUT/sample_0_1.txt" "$OUT/sample_1_1.txt"; then
    echo "sample: the same text with and without the device top-k" | tee -a "$OUT/sample.log"
  else
    echo "sample: TEXT DIFFERS with the device top-k" | tee -a "$OUT/sample.log"
  fi
  t "sampled decoding a/b done"
fi

if has bench; then
  timeout ${BENCH_S:-200} $G/cuda_bench /tmp/l3b.gguf --depth 4096 --par ${PAR:-4,16,64} ${BENCH_ARGS:-} 2>&1 | tee "$OUT/cuda_bench.log"
  t "our bench done"
fi

if has prof; then
  # Per-kernel GPU time over pp512 + tg128 at depth 512 + 4 parallel sequences, when Nsight
  # Systems is installed there.
  NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
  if [[ -n "$NSYS" ]]; then
    timeout 150 "$NSYS" profile -o /tmp/prof --force-overwrite true -t cuda \
      $G/cuda_bench /tmp/l3b.gguf --depth 512 --par 4 >/dev/null 2>&1
    timeout 60 "$NSYS" stats -q --report cuda_gpu_kern_sum --format csv /tmp/prof.nsys-rep \
      >"$OUT/kern_sum.csv" 2>&1
    head -25 "$OUT/kern_sum.csv" | cut -c1-200
  else
    t "no nsys found"
  fi
  t "profile done"
fi

if has agree; then
  # The SmolLM2 file twice: default thresholds (64-token prefill on cuBLAS), then with the
  # prefill on the integer path (CROSSOVER_CUDA_GEMM_MIN=64).
  for run in $AGREE; do
    m=${run%:*}
    L=$(left)
    if (( L < 30 )); then t "no time left for the agreement test on $m"; continue; fi
    CROSSOVER_CUDA_GEMM_MIN=${run##*:} CROSSOVER_CUDA_MODELS=$m timeout "$L" $G/model_agree --nocapture 2>&1 \
      | tee -a "$OUT/model_agree.log" | grep -E "rows|load|test result|panicked|SKIPPED|error"
    t "agreement test on $m done (limit $L s)"
  done
fi

if has llama && [[ -n "$BUILD" ]]; then
  wait "$BUILD"; t "llama.cpp build finished (rc $?)"; tail -3 "$OUT/llama_build.log"
  LB=$(( ${END:-590} - ($(date +%s) - T0) )); (( LB > 150 )) && LB=150
  timeout "$LB" /tmp/llama/build/bin/llama-bench -m /tmp/l3b.gguf -p 512 -n 128 -fa 1 -ngl 99 -r 3 \
    -d 0,4096 -o md 2>&1 | tee "$OUT/llama_bench.log"
  t "llama-bench done"
  # Aggregate generation at 4/16/64 parallel sequences after 512-token prompts (the issue's
  # reference shape): LLAMA_PAR=0 skips it.
  if [[ "${LLAMA_PAR:-1}" != 0 ]]; then
    LB=$(( ${END:-590} - ($(date +%s) - T0) )); (( LB > 120 )) && LB=120
    (( LB > 20 )) && timeout "$LB" /tmp/llama/build/bin/llama-batched-bench -m /tmp/l3b.gguf \
      -c 41984 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 4,16,64 -fa on -ngl 99 2>&1 \
      | grep -E '^\|' | tee "$OUT/llama_batched.log"
    t "llama-batched-bench done"
  fi
fi

