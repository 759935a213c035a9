#!/usr/bin/env bash
# Builds llama-cpp-python from its source package into the system python3, CPU only.
#
# llama.cpp is the independent reference the engine is checked and benchmarked against
# (scripts/ref_logits.py, bench/compare_cpu.py, scripts/check_llama_loads.py). It is built from
# source rather than taken as a wheel so that its CPU feature set is known: native detection
# turns on AMX, which is listed in cpuinfo on these machines but faults (SIGILL) when used, so
# on x86-64 the flags below name every feature explicitly and switch AMX off (elsewhere, e.g.
# aarch64, native detection is used).
#
# Idempotent: does nothing when `import llama_cpp` already reports the wanted version.
#
# Environment:
#   PYTHON               interpreter to install into (default: python3)
#   CROSSOVER_CACHE      cache root (default: <repo>/.cache); the sdist is kept in $CROSSOVER_CACHE/sdist
#   LLAMA_CPP_SDIST_DIR  a folder already holding llama_cpp_python-<version>.tar.gz (optional)
#   LLAMA_CPP_JOBS       parallel compile jobs (default: number of CPUs)
#   LLAMA_CPP_FORCE=1    rebuild even when the right version is importable
#   LLAMA_CPP_AVX2=DIR   instead: an x86-64 build limited to AVX2/FMA/F16C (no AVX-512), as
#                        llama.cpp runs on CPUs without AVX-512, installed into DIR (pip --target;
#                        use it with PYTHONPATH=DIR), for comparisons at the AVX2 level
#                        (`CROSSOVER_ISA=avx2 PYTHONPATH=DIR python3 bench/compare_cpu.py`)
set -euo pipefail

VERSION=0.3.36
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE_ROOT=${CROSSOVER_CACHE:-$REPO/.cache}
SDIST_NAME=llama_cpp_python-$VERSION.tar.gz
JOBS=${LLAMA_CPP_JOBS:-$(nproc 2>/dev/null || echo 2)}

installed_version() {
    "$PY" -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null || true
}

if [[ -z "${LLAMA_CPP_AVX2:-}" && "${LLAMA_CPP_FORCE:-0}" != 1 && "$(installed_version)" == "$VERSION" ]]; then
    echo "llama-cpp-python $VERSION already installed for $PY"
    exit 0
fi

# Find the source package, or fetch it. Only llama-cpp-python itself must come from source;
# its build tools (scikit-build-core, cmake, ninja) may be wheels, which is much faster than
# `--no-binary :all:` (that compiles cmake itself on a 2-core machine).
SDIST=""
for dir in "${LLAMA_CPP_SDIST_DIR:-}" "$CACHE_ROOT/sdist"; do
    if [[ -n "$dir" && -f "$dir/$SDIST_NAME" ]]; then
        SDIST="$dir/$SDIST_NAME"
        break
    fi
done
if [[ -z "$SDIST" ]]; then
    mkdir -p "$CACHE_ROOT/sdist"
    "$PY" -m pip download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -d "$CACHE_ROOT/sdist"
    SDIST="$CACHE_ROOT/sdist/$SDIST_NAME"
fi
echo "building from $SDIST with $JOBS jobs"

# LLAVA_BUILD=OFF: the multimodal library is loaded only by the vision chat handlers, which this
# project never uses; skipping it saves a large part of the compile time.
# On aarch64 (and anything else) the compiler's native detection picks the CPU's features
# (dotprod, i8mm, ...), as a user's own build there would; there is no AMX trap off x86.
case "$(uname -m)" in
    x86_64 | amd64)
        FEATURES="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
        ;;
    *) FEATURES="-DGGML_NATIVE=ON" ;;
esac
if [[ -n "${LLAMA_CPP_AVX2:-}" ]]; then
    FEATURES="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi
export CMAKE_ARGS="$FEATURES -DGGML_CUDA=OFF -DLLAVA_BUILD=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
export MAKEFLAGS=-j$JOBS

# --no-cache-dir: a wheel cached from an earlier build may carry other CMAKE_ARGS.
force=()
if [[ "${LLAMA_CPP_FORCE:-0}" == 1 ]]; then
    force=(--force-reinstall --no-deps)
fi
if [[ -n "${LLAMA_CPP_AVX2:-}" ]]; then
    mkdir -p "$LLAMA_CPP_AVX2"
    "$PY" -m pip install --no-cache-dir --upgrade --target "$LLAMA_CPP_AVX2" --no-binary llama-cpp-python "$SDIST"
    PYTHONPATH="$LLAMA_CPP_AVX2" "$PY" -c 'import llama_cpp; print("llama.cpp (AVX2 build):", llama_cpp.llama_print_system_info().decode())'
    exit 0
fi
"$PY" -m pip install --no-cache-dir "${force[@]}" --no-binary llama-cpp-python -v "$SDIST"

got=$(installed_version)
if [[ "$got" != "$VERSION" ]]; then
    echo "error: after the build, llama_cpp reports version '$got', expected $VERSION" >&2
    exit 1
fi
# Show what the library was compiled with; AMX must not appear as enabled.
"$PY" - <<'EOF'
import llama_cpp
info = llama_cpp.llama_print_system_info().decode()
print("llama.cpp system info:", info)
if "AMX_INT8 = 1" in info:
    raise SystemExit("error: llama.cpp was built with AMX, which faults on these machines")
EOF
echo "llama-cpp-python $VERSION ready for $PY"
