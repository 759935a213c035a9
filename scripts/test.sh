#!/usr/bin/env bash
# The project's test command (the README's second command; CI runs it through .ci/run).
# Installs what the tests need through the repo's own scripts, then runs every test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
# Python references the tests call (the gguf package for cross-checks).
"$PY" -m pip install -q -r scripts/requirements-test.txt
# Data the tests read: the default model and llama.cpp's tokenizer test vectors.
scripts/fetch_model.sh >/dev/null
if [[ -x scripts/fetch_vocabs.sh ]]; then scripts/fetch_vocabs.sh >/dev/null; fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --release -- -D warnings
cargo test --workspace --release "$@"
