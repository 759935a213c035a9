#!/usr/bin/env bash
# The NEON level on aarch64, from an x86-64 machine (this one and CI): cross-builds for
# aarch64-unknown-linux-gnu and runs under qemu-user (linker and runner set below, through
# cargo's CARGO_TARGET_<triple>_* variables, so a native aarch64 build is left alone). On an
# aarch64 host it does nothing: scripts/test.sh's workspace tests already ran the NEON level.
#
#   0. clippy (-D warnings) of the whole workspace for aarch64 Linux and for aarch64 macOS
#      (type-checked only: no Mac here);
#   1. the kernel crate's tests (`quant`: every NEON kernel bit for bit against the scalar
#      reference, quantizers, f32 helpers), twice: on a CPU with the 8-bit dot product (qemu's
#      `max`, as Neoverse N1/V1 or Apple M1 and later) and on one without (Cortex-A72);
#   2. the CPU engine's unit tests (attention and RoPE on NEON against their scalar forms) and
#      its teacher-forced test on the real SmolLM2 file: its logits against
#      llama.cpp's fixture, bit for bit (~7 min under qemu: qemu-user emulates floating point in
#      software, so the engine's other tests stay on x86-64);
#   3. the README's first command: the real SmolLM2 model answering under qemu on the NEON level,
#      with and without `sdot`.
#
# Installs what it needs through rustup and apt (the aarch64 standard library, a cross linker,
# qemu-user). Where that cannot be installed the NEON tests are SKIPPED with a message saying
# what is missing; a failing test fails the script. Called by scripts/test.sh; alone:
#   scripts/test_neon.sh            (1, 2 and 3)
#   scripts/test_neon.sh --quick    (1 only)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TARGET=aarch64-unknown-linux-gnu
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
if [ "$(uname -m)" = aarch64 ]; then
    echo "NEON: native aarch64 host; the workspace tests ran the NEON level itself" >&2
    exit 0
fi
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"

skip() {
    echo "NEON tests SKIPPED: $*" >&2
    exit 0
}

# Run a command under qemu-user; if qemu itself killed the guest ("qemu: uncaught target
# signal"), run it once more. qemu-user 7.2 (Debian 12's) now and then kills a guest that runs
# many threads with a signal 11 that the same binary does not show again: CI saw one in
# tests/dot_kernels.rs (fixed seeds) that 14 runs here of each CPU did not repeat. What such a
# crash would be in our own code, a kernel reading past a buffer's end, faults every run in
# tests/dot_bounds.rs (guard pages), so a crash that does not come back is qemu's. A test that
# fails (an assertion, a panic) is not retried, and a second crash fails the script.
under_qemu() {
    local log rc=0
    log=$(mktemp)
    "$@" 2>&1 | tee "$log" || rc=${PIPESTATUS[0]}
    if [ "$rc" != 0 ] && grep -q "qemu: uncaught target signal" "$log"; then
        echo "NEON: qemu-user killed the guest (above); running the same command once more" >&2
        rc=0
        "$@" || rc=$?
    fi
    rm -f "$log"
    return "$rc"
}

if ! rustup target list --installed 2>/dev/null | grep -qx "$TARGET"; then
    rustup target add "$TARGET" >/dev/null 2>&1 || skip "could not install the $TARGET standard library (rustup target add $TARGET)"
fi
need=()
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64 >/dev/null || need+=(qemu-user)
if ((${#need[@]})); then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo -n"
    export DEBIAN_FRONTEND=noninteractive
    if ! $SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
        $SUDO apt-get update -q >/dev/null 2>&1 || true
        $SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null 2>&1 ||
            skip "could not install ${need[*]} with apt-get"
    fi
fi

echo "== NEON: clippy of the workspace for aarch64 Linux" >&2
cargo clippy --release --target "$TARGET" --workspace --all-targets -- -D warnings
# macOS on Apple silicon: type-checked only (no linker or Mac here); skipped where rustup
# cannot add the target.
if rustup target list --installed 2>/dev/null | grep -qx aarch64-apple-darwin ||
    rustup target add aarch64-apple-darwin >/dev/null 2>&1; then
    echo "== NEON: clippy of the workspace for aarch64 macOS" >&2
    cargo clippy --release --target aarch64-apple-darwin --workspace --all-targets -- -D warnings
else
    echo "NEON: aarch64-apple-darwin check SKIPPED: rustup could not add the target" >&2
fi
echo "== NEON: quant kernels, CPU with sdot (qemu max)" >&2
QEMU_CPU=max under_qemu cargo test --release --target "$TARGET" -p quant
echo "== NEON: quant kernels, CPU without sdot (qemu cortex-a72)" >&2
QEMU_CPU=cortex-a72 under_qemu cargo test --release --target "$TARGET" -p quant
[ "$QUICK" = 1 ] && exit 0

echo "== NEON: CPU engine's unit tests (attention and RoPE against their scalar forms)" >&2
QEMU_CPU=max under_qemu cargo test --release --target "$TARGET" -p cpu --lib

echo "== NEON: CPU engine, teacher-forced against llama.cpp (SmolLM2, bit for bit)" >&2
QEMU_CPU=max under_qemu cargo test --release --target "$TARGET" -p cpu --test teacher_forced \
    smollm2_q4_1_matches_llama_cpp -- --exact --nocapture

echo "== NEON: the README's first command under qemu" >&2
cargo build --release --target "$TARGET" -p crossover
for cpu in max cortex-a72; do
    out=$(QEMU_CPU=$cpu under_qemu qemu-aarch64 -L /usr/aarch64-linux-gnu "target/$TARGET/release/crossover" \
        run --chat --temp 0 -n 24 --system "You are a helpful assistant." \
        "What is the capital of France?" 2>&1)
    echo "$out" >&2
    # llama.cpp answers "The capital of France is Paris." on this file (crates/cpu tests).
    grep -q "neon" <<<"$out" || { echo "NEON ($cpu): the CPU backend did not report the neon level" >&2; exit 1; }
    grep -q "Paris" <<<"$out" || { echo "NEON ($cpu): the answer does not name Paris" >&2; exit 1; }
done
