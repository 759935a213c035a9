#!/usr/bin/env bash
# The project's test command (the README's second command; CI runs it through .ci/run).
# Installs what the tests need through the repo's own scripts, then runs every test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
# Python references the tests call (the gguf package for cross-checks).
"$PY" -m pip install -q -r scripts/requirements-test.txt
# NVRTC from PyPI so the CUDA kernels are compiled for sm_90 on a machine without a GPU
# (crates/cuda/tests/nvrtc_compile.rs fails, rather than skips, when CROSSOVER_REQUIRE_NVRTC=1).
"$PY" -m pip install -q "nvidia-cuda-nvrtc>=13,<14"
NVRTC_LIB=$("$PY" -c 'import nvidia.cu13, os; print(os.path.join(list(nvidia.cu13.__path__)[0], "lib"))')
export LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CROSSOVER_REQUIRE_NVRTC=1
# Data the tests read: the default model and llama.cpp's tokenizer test vectors.
scripts/fetch_model.sh >/dev/null
scripts/fetch_vocabs.sh >/dev/null
# The synthetic 1B model the CPU engine's teacher-forced fixture was made from (deterministic).
scripts/synth_model.sh --for-fixture crates/cpu/tests/fixtures/synth_llama1b_q4_k_m_logits.json >/dev/null

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release -- -D warnings
cargo test --workspace --release "$@"
# The CPU engine on the AVX2 level (what an x86-64 machine without AVX-512 runs): llama.cpp's
# logits bit for bit there too. Skipped on a machine without AVX2 (the level is then unused).
if grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo && grep -qw f16c /proc/cpuinfo; then
    CROSSOVER_ISA=avx2 cargo test --release -p cpu --test teacher_forced "$@"
else
    echo "AVX2 engine test skipped: this CPU has no AVX2/FMA/F16C"
fi
# The NEON kernels (aarch64) under qemu-user: cross-built, bit for bit against the scalar
# reference, and the default model answering (skips with a message where the cross tools
# cannot be installed).
scripts/test_neon.sh
