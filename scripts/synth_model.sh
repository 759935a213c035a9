#!/usr/bin/env bash
# Makes a synthetic model with `crossover synth` into the git-ignored model cache.
#
#   scripts/synth_model.sh PRESET QUANT [SEED]      e.g.  scripts/synth_model.sh llama-3.2-1b q4_k_m
#   scripts/synth_model.sh --for-fixture FIXTURE.json
#
# The weights are random but fixed by the seed (default 1): the same command writes the same
# bytes. The first form reuses an existing output (SYNTH_FORCE=1 makes it again). The second form
# remakes the model a scripts/ref_logits.py fixture was made from: it runs the fixture's recorded
# `synth_command`, writes to $CROSSOVER_CACHE/models/<model.name>, and checks the fixture's
# sha256; a cached file with the right hash is reused. A mismatch means `crossover synth` now
# writes something else, and the fixture must be made again (docs/reference-tooling.md).
# The presets' default vocabularies come from the cache, filled by scripts/fetch_model.sh and
# scripts/fetch_vocabs.sh, which run first.
#
# Prints the model's path as its last line.
#
# Environment:
#   CROSSOVER_CACHE  cache root (default: <repo>/.cache); models go to $CROSSOVER_CACHE/models/
#   CROSSOVER_BIN    the crossover binary (default: built with `cargo run --release -p crossover`)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE_ROOT=${CROSSOVER_CACHE:-$REPO/.cache}
export CROSSOVER_CACHE=$CACHE_ROOT
PY=${PYTHON:-python3}

usage() {
    echo "usage: $0 PRESET QUANT [SEED] | $0 --for-fixture FIXTURE.json" >&2
    exit 2
}

EXPECT_SHA=""
if [[ "${1:-}" == "--for-fixture" ]]; then
    [[ $# -eq 2 ]] || usage
    FIXTURE=$2
    # Line 1: the file name; line 2: the sha256; then one synth argument per line.
    mapfile -t META < <("$PY" - "$FIXTURE" <<'EOF'
import json, sys
fx = json.load(open(sys.argv[1]))
cmd = fx["model"].get("synth_command")
if not cmd or cmd[0] != "synth":
    sys.exit(f"{sys.argv[1]}: model.synth_command is {cmd!r}, not a `crossover synth` command")
print(fx["model"]["name"])
print(fx["model"]["sha256"])
for a in cmd:
    print(a)
EOF
    )
    [[ ${#META[@]} -ge 3 ]] || exit 1
    DEST=$CACHE_ROOT/models/${META[0]}
    EXPECT_SHA=${META[1]}
    ARGS=("${META[@]:2}")
else
    [[ $# -ge 2 && $# -le 3 ]] || usage
    PRESET=$1
    QUANT=$2
    SEED=${3:-1}
    DEST=$CACHE_ROOT/models/synth-$PRESET-$QUANT-s$SEED.gguf
    ARGS=(synth --preset "$PRESET" --quant "$QUANT" --seed "$SEED")
fi

sha_of() {
    sha256sum "$1" | cut -d' ' -f1
}

if [[ -f "$DEST" ]]; then
    if [[ -n "$EXPECT_SHA" ]]; then
        if [[ "$(sha_of "$DEST")" == "$EXPECT_SHA" ]]; then
            echo "$DEST"
            exit 0
        fi
        echo "note: $DEST is not the fixture's file; making it again" >&2
    elif [[ "${SYNTH_FORCE:-0}" != 1 ]]; then
        echo "$DEST"
        exit 0
    fi
fi

"$REPO/scripts/fetch_model.sh" >&2
if [[ -x "$REPO/scripts/fetch_vocabs.sh" ]]; then
    "$REPO/scripts/fetch_vocabs.sh" >&2
fi
mkdir -p "$CACHE_ROOT/models"

TMP=$DEST.tmp.$$
trap 'rm -f "$TMP"' EXIT
if [[ -n "${CROSSOVER_BIN:-}" ]]; then
    "$CROSSOVER_BIN" "${ARGS[@]}" -q -o "$TMP" >&2
else
    (cd "$REPO" && cargo run --release -q -p crossover -- "${ARGS[@]}" -q -o "$TMP") >&2
fi
if [[ -n "$EXPECT_SHA" ]]; then
    got=$(sha_of "$TMP")
    if [[ "$got" != "$EXPECT_SHA" ]]; then
        echo "error: \`crossover ${ARGS[*]}\` now writes a file with sha256 $got, but $FIXTURE" \
            "was made from one with $EXPECT_SHA: make the fixture again with scripts/ref_logits.py" \
            "(see docs/reference-tooling.md)" >&2
        exit 1
    fi
fi
mv -f "$TMP" "$DEST"
trap - EXIT
echo "$DEST"
