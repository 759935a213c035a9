#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer test vectors into the git-ignored cache: the vocabulary-only GGUF
# files `ggml-vocab-*.gguf` with their `.gguf.inp` / `.gguf.out` pairs, and the chat templates
# under models/templates/, as shipped inside the llama-cpp-python 0.3.36 source package.
#
# Model hubs are unreachable; PyPI is not. `pip download` gets the source package (no install);
# only the files under vendor/llama.cpp/models/ are taken out of it. A source package already
# downloaded (by scripts/setup_llama_cpp.sh, or named by LLAMA_CPP_SDIST_DIR) is reused.
#
# Idempotent: when the vocab folder already holds the files, nothing is fetched.
# Prints the vocab folder as its last line of output.
#
# Environment:
#   PYTHON               interpreter whose pip is used (default: python3)
#   CROSSOVER_CACHE      cache root (default: <repo>/.cache); files go to $CROSSOVER_CACHE/vocab/
#   LLAMA_CPP_SDIST_DIR  a folder already holding llama_cpp_python-0.3.36.tar.gz (optional)
set -euo pipefail

VERSION=0.3.36
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE_ROOT=${CROSSOVER_CACHE:-$REPO/.cache}
DEST=$CACHE_ROOT/vocab
SDIST_NAME=llama_cpp_python-$VERSION.tar.gz
PREFIX=llama_cpp_python-$VERSION/vendor/llama.cpp/models
STAMP=$DEST/.complete-$VERSION

if [[ -f "$STAMP" ]]; then
    echo "$DEST"
    exit 0
fi

SDIST=""
for dir in "${LLAMA_CPP_SDIST_DIR:-}" "$CACHE_ROOT/sdist"; do
    if [[ -n "$dir" && -f "$dir/$SDIST_NAME" ]]; then
        SDIST="$dir/$SDIST_NAME"
        break
    fi
done
if [[ -z "$SDIST" ]]; then
    mkdir -p "$CACHE_ROOT/sdist"
    # Only llama-cpp-python itself must be the source package; pip may take its build tools as
    # wheels when it prepares the package metadata (`--no-binary :all:` would compile cmake).
    "$PY" -m pip download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -d "$CACHE_ROOT/sdist" >&2
    SDIST="$CACHE_ROOT/sdist/$SDIST_NAME"
fi
if [[ ! -f "$SDIST" ]]; then
    echo "error: pip did not leave $SDIST" >&2
    exit 1
fi

TMP=$(mktemp -d "$CACHE_ROOT/vocab-tmp.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
tar -xzf "$SDIST" -C "$TMP" --wildcards "$PREFIX/ggml-vocab-*" "$PREFIX/templates/*"
count=$(find "$TMP/$PREFIX" -maxdepth 1 -name 'ggml-vocab-*.gguf' | wc -l)
if [[ "$count" -eq 0 ]]; then
    echo "error: no ggml-vocab-*.gguf in $SDIST" >&2
    exit 1
fi
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$TMP/$PREFIX"/ggml-vocab-* "$DEST/"
mv "$TMP/$PREFIX/templates" "$DEST/templates"
touch "$STAMP"
echo "fetched $count vocab files" >&2
echo "$DEST"
