#!/usr/bin/env bash
# Makes a synthetic model with `crossover synth` into the git-ignored model cache.
#
#   scripts/synth_model.sh PRESET QUANT [SEED]     e.g.  scripts/synth_model.sh llama-3.2-1b q4_k_m
#
# The weights are random but fixed by the seed (default 1): the same command writes the same
# bytes, so a reference fixture made from the file (scripts/ref_logits.py records the command and
# the file's sha256) stays valid on any machine that runs this script. The preset's default
# vocabulary comes from the cache, filled by scripts/fetch_model.sh and scripts/fetch_vocabs.sh,
# which this script runs first.
#
# Idempotent: an existing output is reused. Prints the model's path as its last line.
#
# Environment:
#   CROSSOVER_CACHE  cache root (default: <repo>/.cache); the model goes to $CROSSOVER_CACHE/models/
#   CROSSOVER_BIN    the crossover binary (default: built with `cargo run --release -p crossover`)
set -euo pipefail

if [[ $# -lt 2 || $# -gt 3 ]]; then
    echo "usage: $0 PRESET QUANT [SEED]" >&2
    exit 2
fi
PRESET=$1
QUANT=$2
SEED=${3:-1}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE_ROOT=${CROSSOVER_CACHE:-$REPO/.cache}
export CROSSOVER_CACHE=$CACHE_ROOT
DEST=$CACHE_ROOT/models/synth-$PRESET-$QUANT-s$SEED.gguf

if [[ -f "$DEST" ]]; then
    echo "$DEST"
    exit 0
fi

"$REPO/scripts/fetch_model.sh" >&2
if [[ -x "$REPO/scripts/fetch_vocabs.sh" ]]; then
    "$REPO/scripts/fetch_vocabs.sh" >&2
fi
mkdir -p "$CACHE_ROOT/models"

TMP=$DEST.tmp.$$
trap 'rm -f "$TMP"' EXIT
ARGS=(synth --preset "$PRESET" --quant "$QUANT" --seed "$SEED" -q -o "$TMP")
if [[ -n "${CROSSOVER_BIN:-}" ]]; then
    "$CROSSOVER_BIN" "${ARGS[@]}" >&2
else
    (cd "$REPO" && cargo run --release -q -p crossover -- "${ARGS[@]}") >&2
fi
mv -f "$TMP" "$DEST"
trap - EXIT
echo "$DEST"
