#!/usr/bin/env python3
"""Checks that GGUF files load and run in llama.cpp (llama-cpp-python 0.3.36).

Written for the synthetic models of `crossover synth`: the model I/O issue requires that they
load in llama.cpp. For each file: load it (CPU, mmap), print llama.cpp's view of it (size,
parameters, layers, width, heads, vocabulary, description), tokenize a sentence, evaluate it with
logits for every position, require all logits finite and not all equal in a row, and decode a few
tokens greedily. Exits non-zero if any file fails.

Usage:
  python3 scripts/check_llama_loads.py FILE.gguf [FILE.gguf ...]
  python3 scripts/check_llama_loads.py --synth llama-3.2-1b:q4_k_m [--synth PRESET:QUANT ...]
    (--synth makes the model first with scripts/synth_model.sh)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SENTENCE = b"The lighthouse on the northern cape was built in 1871, after a winter storm."


def check(path: Path, threads: int) -> bool:
    import llama_cpp

    print(f"== {path}")
    t0 = time.perf_counter()
    try:
        llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=256,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=True,
            verbose=False,
        )
    except Exception as e:  # llama.cpp reports failures to load as a ValueError
        print(f"   FAIL: llama.cpp could not load it: {e}")
        return False
    model = llm._model.model
    desc = ctypes_string(lambda buf, n: llama_cpp.llama_model_desc(model, buf, n))
    print(
        f"   loaded in {time.perf_counter() - t0:.1f} s: {desc}; "
        f"{llama_cpp.llama_model_n_params(model) / 1e6:.1f} M params, "
        f"{llama_cpp.llama_model_size(model) / 2**20:.1f} MiB, "
        f"{llama_cpp.llama_model_n_layer(model)} layers, "
        f"width {llama_cpp.llama_model_n_embd(model)}, "
        f"{llama_cpp.llama_model_n_head(model)} heads / "
        f"{llama_cpp.llama_model_n_head_kv(model)} KV heads, "
        f"vocab {llm.n_vocab()}, trained ctx {llama_cpp.llama_model_n_ctx_train(model)}"
    )
    tokens = llm.tokenize(SENTENCE, add_bos=True, special=False)
    llm.eval(tokens)
    scores = np.asarray(llm.scores[: len(tokens)])
    ok = True
    if not np.isfinite(scores).all():
        print("   FAIL: non-finite logits")
        ok = False
    if (scores.max(axis=1) == scores.min(axis=1)).any():
        print("   FAIL: a logit row with all values equal")
        ok = False
    llm.reset()
    out = llm.create_completion(
        SENTENCE.decode(), max_tokens=8, temperature=0.0, top_k=1, repeat_penalty=1.0
    )
    print(
        f"   {len(tokens)} prompt tokens evaluated; logits range "
        f"[{scores.min():.2f}, {scores.max():.2f}]; greedy continuation: "
        f"{out['choices'][0]['text']!r}"
    )
    print(f"   {'ok' if ok else 'FAILED'}")
    return ok


def ctypes_string(fill) -> str:
    import ctypes

    buf = ctypes.create_string_buffer(256)
    fill(buf, 256)
    return buf.value.decode(errors="replace")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--synth", action="append", default=[], metavar="PRESET:QUANT")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    files = list(args.files)
    for spec in args.synth:
        preset, _, quant = spec.partition(":")
        out = subprocess.run(
            [str(REPO / "scripts/synth_model.sh"), preset, quant or "q4_k_m"],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        ).stdout
        files.append(Path(out.strip().splitlines()[-1]))
    if not files:
        ap.error("give GGUF files or --synth PRESET:QUANT")
    failed = [f for f in files if not check(f, args.threads)]
    if failed:
        print(f"{len(failed)} of {len(files)} failed: {', '.join(map(str, failed))}")
        return 1
    print(f"all {len(files)} loaded and ran in llama.cpp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
