#!/usr/bin/env python3
"""Checks that llama.cpp (llama-cpp-python) loads and runs the models `crossover synth` writes.

For every preset, at tiny scale (2 blocks, one key/value head, byte-level vocabulary) and in several
quantizations, and optionally at full size with the preset's real vocabulary (--full), it writes a
model, loads it in llama.cpp, evaluates a prompt and checks: every logit finite, and their standard
deviation near the generator's design value (3). Prints one line per model; exits 1 on any failure.

Needs llama-cpp-python 0.3.36 (scripts/setup_llama_cpp.sh) and a built binary
(`cargo build --release -p crossover`).

Usage: python3 scripts/check_synth_llama.py [--bin PATH] [--full PRESET ...] [--quant Q ...]
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
PRESETS = {
    # name: divisor of the head counts that leaves one key/value head
    "smollm2-135m": 3,
    "llama-3.2-1b": 8,
    "llama-3.2-3b": 8,
    "llama-3.1-8b": 8,
    "qwen2.5-0.5b": 2,
}
LOGIT_STD = 3.0
PROMPT = b"The quick brown fox jumps over the lazy dog. Paris is the capital of France."


def synth(binary: str, out: str, preset: str, quant: str, tiny: bool) -> None:
    cmd = [binary, "synth", "-q", "--preset", preset, "--quant", quant, "--seed", "7", "-o", out]
    if tiny:
        cmd += ["--layers", "2", "--heads-div", str(PRESETS[preset]), "--byte-vocab"]
    subprocess.run(cmd, check=True, cwd=REPO)


def check(path: str) -> tuple[bool, str]:
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, logits_all=True, verbose=False, n_threads=os.cpu_count())
    toks = llm.tokenize(PROMPT, add_bos=True)
    llm.eval(toks)
    logits = np.array(llm.scores[: len(toks)], dtype=np.float64)
    finite = bool(np.isfinite(logits).all())
    std = logits.std(axis=1)
    ok = finite and bool(np.all(np.abs(std / LOGIT_STD - 1) < 0.25))
    # The prediction must depend on the context: not the same argmax everywhere.
    distinct = len(set(logits.argmax(axis=1).tolist()))
    ok = ok and distinct > 1
    tmpl = "chat template" if llm.metadata.get("tokenizer.chat_template") else "no chat template"
    return ok, (f"{len(toks)} tokens, finite={finite}, logit std {std.min():.2f}..{std.max():.2f}, "
                f"{distinct} distinct argmax, vocab {llm.n_vocab()}, {tmpl}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(REPO / "target" / "release" / "crossover"))
    ap.add_argument("--quant", nargs="*", default=["q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "f16", "bf16", "f32"])
    ap.add_argument("--full", nargs="*", default=[], help="presets to check at full size with their real vocabulary (q4_k_m)")
    args = ap.parse_args()
    if not Path(args.bin).is_file():
        sys.exit(f"{args.bin} not found: run `cargo build --release -p crossover` (or pass --bin)")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(p, q, True) for p in PRESETS for q in args.quant] + [(p, "q4_k_m", False) for p in args.full]
        for preset, quant, tiny in runs:
            path = os.path.join(tmp, f"{preset}-{quant}.gguf")
            synth(args.bin, path, preset, quant, tiny)
            ok, what = check(path)
            failures += not ok
            scale = "tiny" if tiny else "full"
            print(f"{'ok  ' if ok else 'FAIL'} {preset:<13} {quant:<7} {scale}: {what}", flush=True)
            os.remove(path)
    if failures:
        sys.exit(f"{failures} model(s) failed")


if __name__ == "__main__":
    main()
