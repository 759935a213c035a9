#!/usr/bin/env bash
# Build machine side of scripts/gpu_bench.sh: builds the binary, the CUDA test executables and
# the benchmark, strips them and gathers them with the llama.cpp source and two vocabularies in
# .gpu/ (git-ignored), the folder a device run carries.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
# GPU_DIR: the folder to fill (default .gpu); helpers working side by side each carry their own.
G=${GPU_DIR:-.gpu}
mkdir -p "$G"
cargo build --release -p crossover
cargo build --release -p cuda --tests --examples
cp "$CARGO_TARGET_DIR/release/crossover" "$G"/
cp "$CARGO_TARGET_DIR/release/examples/cuda_bench" "$CARGO_TARGET_DIR/release/examples/cuda_trace" "$G"/
for t in kernels model_agree conformance; do
  exe=$(cargo test --release -p cuda --test "$t" --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1)
  cp "$exe" "$G/$t"
done
strip "$G"/crossover "$G"/cuda_bench "$G"/cuda_trace "$G"/kernels "$G"/model_agree "$G"/conformance
L=${LLAMA_SRC:-/work/cache/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp}
# NO_LLAMA_SRC=1: leave the llama.cpp source out (a call that does not build llama.cpp carries less).
[[ -n "${NO_LLAMA_SRC:-}" ]] && rm -f "$G"/llama-src.tar.gz
[[ -n "${NO_LLAMA_SRC:-}" || -f "$G"/llama-src.tar.gz ]] || tar czf "$G"/llama-src.tar.gz -C "$L" CMakeLists.txt cmake ggml src include common tools vendor licenses app
# The two vocabularies: from the llama.cpp source when it is there, else from the vocab cache
# scripts/fetch_vocabs.sh fills.
V=$L/models
[[ -f $V/ggml-vocab-starcoder.gguf ]] || V=$(bash scripts/fetch_vocabs.sh | tail -1)
cp "$V/ggml-vocab-starcoder.gguf" "$V/ggml-vocab-llama-bpe.gguf" "$G"/
# The chat template `crossover synth --preset llama-3.2-1b` completes the vocabulary with
# (scripts/fetch_vocabs.sh fetches it), for the conformance fixture's model.
mkdir -p "$G"/templates && cp .cache/vocab/templates/meta-llama-Llama-3.2-3B-Instruct.jinja "$G"/templates/
du -sh "$G"
