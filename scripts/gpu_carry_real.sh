#!/usr/bin/env bash
# The real SmolLM2-135M-Instruct file (98 MB) is over the 64 MiB one device call carries, so it
# travels in pieces over calls made back to back (a call within 30 s of the last keeps the
# machine and its /tmp; docs/perf/cuda.md session 19).
#
# Build machine:  bash scripts/gpu_prepare.sh; bash scripts/gpu_carry_real.sh split
#   writes .gpu-real1/ and .gpu-real2/ (git-ignored), one half of the file each, the second with
#   .gpu/model_agree beside it (49 + 6.5 MB, under the limit with the tracked files).
# GPU machine, two calls back to back (carry [".gpu-real1"], then [".gpu-real2"]):
#   bash scripts/gpu_carry_real.sh gather .gpu-real1
#   bash scripts/gpu_carry_real.sh gather .gpu-real2 &&
#     CROSSOVER_CUDA_MODELS=/tmp/real.gguf .gpu-real2/model_agree --nocapture
#   the second checks the whole file's sha256 and leaves it at /tmp/real.gguf (the kernels are
#   compiled there, ~100 s: the kernel cache does not fit beside the piece).
# Session 28: FIRST (bytes of the first piece, default half) and WITH (the .gpu files that go
# with the second piece, default model_agree; KCACHE=1 puts .gpu/kcache beside the first piece,
# which gather copies to /tmp/cuda-cache). The conformance run: FIRST=43000000 KCACHE=1
# WITH=conformance, then on the machine the fixture's path .cache/models/<file> is /tmp/real.gguf.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
M=.cache/models/smollm2-135m-instruct-q4_1.gguf
case "${1:-}" in
  split)
    [[ -f $M ]] || scripts/fetch_model.sh >/dev/null
    rm -rf .gpu-real1 .gpu-real2 && mkdir -p .gpu-real1 .gpu-real2
    size=$(stat -c %s "$M")
    half=${FIRST:-$(( size / 2 ))}
    head -c "$half" "$M" > .gpu-real1/piece
    tail -c +"$(( half + 1 ))" "$M" > .gpu-real2/piece
    sha256sum "$M" | cut -d' ' -f1 > .gpu-real2/sha256
    echo 1 > .gpu-real1/index
    echo 2 > .gpu-real2/index
    for f in ${WITH:-model_agree}; do
      if [[ -f .gpu/$f ]]; then
        cp ".gpu/$f" .gpu-real2/
      else
        echo "no .gpu/$f: run scripts/gpu_prepare.sh first" >&2
      fi
    done
    [[ -n "${KCACHE:-}" && -d .gpu/kcache ]] && cp -r .gpu/kcache .gpu-real1/
    du -sh .gpu-real1 .gpu-real2
    ;;
  gather)
    d=${2:?usage: $0 gather DIR}
    i=$(cat "$d/index")
    if [[ $i == 1 ]]; then
      cp "$d/piece" /tmp/real.gguf.part
      if [[ -d $d/kcache ]]; then mkdir -p /tmp/cuda-cache && cp -r "$d/kcache/." /tmp/cuda-cache/; fi
    else
      [[ -f /tmp/real.gguf.part ]] || { echo "piece 1 is not on this machine (the machine was given back?)" >&2; exit 1; }
      cat "$d/piece" >> /tmp/real.gguf.part
      want=$(cat "$d/sha256")
      got=$(sha256sum /tmp/real.gguf.part | cut -d' ' -f1)
      [[ $got == "$want" ]] || { echo "sha256 $got, want $want" >&2; exit 1; }
      mv /tmp/real.gguf.part /tmp/real.gguf
      echo "/tmp/real.gguf: $(stat -c %s /tmp/real.gguf) bytes, sha256 $got"
    fi
    ;;
  *)
    echo "usage: $0 split | gather DIR" >&2
    exit 2
    ;;
esac
