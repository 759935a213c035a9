#!/usr/bin/env python3
"""Teacher-forced reference logits from llama.cpp (llama-cpp-python 0.3.36).

Feeds a fixed text through llama.cpp in one pass with logits kept for every position and
writes a compact JSON fixture that the CPU engine's tests compare against: at each position
the top-K (token id, logit) pairs of llama.cpp's logit row and the log-sum-exp of the *whole*
row. With the log-sum-exp a test recovers llama.cpp's exact probabilities of those K tokens,
p_ref(t) = exp(logit_t - lse), and the reference's probability mass outside them, so it can
compute top-1 agreement and KL divergences against the engine's full distribution: over the K
tokens plus one "rest" bucket (a lower bound of the full KL, by the data-processing inequality),
and, with the tail samples described below, an unbiased estimate of the full KL.

Fixture layout (JSON object; see docs/reference-tooling.md):
  format          "crossover-ref-logits/1"
  generator       "scripts/ref_logits.py"
  llama_cpp_python  version of the package that produced it
  model           {file, name, sha256, size_bytes, synth_command}: file is the model's path
                  relative to the repo root (e.g. .cache/models/x.gguf; absolute if outside),
                  name its file name; synth_command is null, or the `crossover` argument
                  list that regenerates a synthetic model deterministically
  text_file, text_sha256   the input text (path relative to the repo root)
  add_special     true: tokenized with llama.cpp's add-special rule (BOS only where the
                  model's metadata asks for it); parse_special false
  n_vocab, n_ctx, n_batch, n_threads, flash_attn, kv_type
  top_k           K
  n_tokens        len(tokens)
  tokens          token ids fed to the model, in order
  positions       list of n_tokens objects, one per fed token; positions[i] describes the
                  logit row produced after token i, i.e. the prediction of token i+1:
                    ids     top-K token ids, highest logit first (ties: lower id first)
                    logits  their logits (float32 values, shortest exact decimal form)
                    lse     log(sum(exp(row))) over all n_vocab logits (float64 sum)
                    entropy entropy of softmax(row) in nats (float64)
                    tail_ids, tail_logits   S token ids drawn (with replacement) from
                            llama.cpp's distribution restricted to the tokens NOT in ids
                            (renormalized), and their logits; see "tail samples" below
  tail_samples    S, the number of tail draws per position
  tail_seed       seed of the draws (numpy PCG64), so the fixture is reproducible

Tail samples: with the top-K logits exact and S draws from the rest, a test can estimate the
full KL(llama.cpp || ours) without the full rows: with d(v) = log p_ref(v) - log p_ours(v),
  KL = sum_{v in ids} p_ref(v) d(v) + P_tail * E_{v ~ p_ref | tail}[d(v)],
P_tail = 1 - sum_{v in ids} p_ref(v); the first term is exact, the second is estimated without
bias by the mean of d over tail_ids. This matters for flat distributions (random-weight
synthetic models), where the top-K hold a small part of the mass.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FORMAT = "crossover-ref-logits/1"
LLAMA_CPP_VERSION = "0.3.36"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def repo_relative(path: Path) -> str:
    p = path.resolve()
    try:
        return str(p.relative_to(REPO))
    except ValueError:
        return str(p)


def f32(x: float) -> float:
    """The float32 value as the shortest decimal that reads back to the same float32."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


def load_llama(model: Path, n_ctx: int, n_batch: int, threads: int, logits_all: bool):
    import llama_cpp

    if llama_cpp.__version__ != LLAMA_CPP_VERSION:
        sys.exit(
            f"error: llama_cpp is {llama_cpp.__version__}, need {LLAMA_CPP_VERSION} "
            "(run scripts/setup_llama_cpp.sh)"
        )
    return llama_cpp.Llama(
        model_path=str(model),
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_batch,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        flash_attn=False,
        verbose=False,
    )


def row_stats(row: np.ndarray, k: int, n_tail: int, rng: np.random.Generator) -> dict:
    # Stable top-K: sort by (-logit, id) so ties are broken the same way every time.
    top = np.lexsort((np.arange(row.shape[0]), -row))[:k]
    r64 = row.astype(np.float64)
    m = r64.max()
    e = np.exp(r64 - m)
    s = e.sum()
    lse = m + np.log(s)
    p = e / s
    entropy = float(-(p * (r64 - lse)).sum())
    tail_p = p.copy()
    tail_p[top] = 0.0
    tail_mass = tail_p.sum()
    if n_tail > 0 and tail_mass > 0.0:
        tail = rng.choice(row.shape[0], size=n_tail, replace=True, p=tail_p / tail_mass)
    else:
        tail = np.zeros(0, dtype=np.int64)
    return {
        "ids": [int(t) for t in top],
        "logits": [f32(row[t]) for t in top],
        "lse": float(lse),
        "entropy": entropy,
        "tail_ids": [int(t) for t in tail],
        "tail_logits": [f32(row[t]) for t in tail],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="GGUF model file")
    ap.add_argument(
        "--text",
        type=Path,
        default=REPO / "crates/cpu/tests/fixtures/teacher_text.txt",
        help="UTF-8 text to feed (default: the committed teacher text)",
    )
    ap.add_argument("--out", required=True, type=Path, help="fixture to write (JSON)")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tail-samples", type=int, default=32, help="tail draws per position")
    ap.add_argument("--tail-seed", type=int, default=20251130)
    ap.add_argument(
        "--synth-command",
        default=None,
        help="the crossover synth arguments that made MODEL (recorded in the fixture), "
        "e.g. 'synth --preset llama-3.2-1b --quant q4_k_m --seed 7'",
    )
    ap.add_argument(
        "--min-tokens", type=int, default=256, help="refuse texts shorter than this"
    )
    args = ap.parse_args()

    if not args.model.is_file():
        sys.exit(f"error: model {args.model} not found (run scripts/fetch_model.sh?)")
    text = args.text.read_bytes()
    text.decode("utf-8")  # must be valid UTF-8

    # Tokenize with the model's own rules first (vocab-only load is cheap), so the context
    # can be sized to the text.
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(args.model), vocab_only=True, verbose=False)
    tokens = vocab.tokenize(text, add_bos=True, special=False)
    del vocab
    n = len(tokens)
    if n < args.min_tokens:
        sys.exit(f"error: text gives {n} tokens, fewer than --min-tokens {args.min_tokens}")

    # One batch for the whole text: every row comes from the same (batched) code path.
    llm = load_llama(args.model, n_ctx=n, n_batch=n, threads=args.threads, logits_all=True)
    llm.eval(tokens)
    scores = np.asarray(llm.scores[:n], dtype=np.float32)
    if not np.isfinite(scores).all():
        sys.exit("error: llama.cpp produced non-finite logits")

    rng = np.random.Generator(np.random.PCG64(args.tail_seed))
    positions = [row_stats(scores[i], args.top_k, args.tail_samples, rng) for i in range(n)]
    fixture = {
        "format": FORMAT,
        "generator": "scripts/ref_logits.py",
        "llama_cpp_python": llama_cpp.__version__,
        "model": {
            "file": repo_relative(args.model),
            "name": args.model.name,
            "sha256": sha256_file(args.model),
            "size_bytes": args.model.stat().st_size,
            "synth_command": args.synth_command.split() if args.synth_command else None,
        },
        "text_file": repo_relative(args.text),
        "text_sha256": hashlib.sha256(text).hexdigest(),
        "add_special": True,
        "n_vocab": int(llm.n_vocab()),
        "n_ctx": n,
        "n_batch": n,
        "n_threads": args.threads,
        "flash_attn": False,
        "kv_type": "f16",
        "top_k": args.top_k,
        "tail_samples": args.tail_samples,
        "tail_seed": args.tail_seed,
        "n_tokens": n,
        "tokens": [int(t) for t in tokens],
        "positions": positions,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        # One position per line: compact, yet diffs stay readable.
        f.write("{\n")
        items = [(k, v) for k, v in fixture.items() if k != "positions"]
        for k, v in items:
            f.write(f"  {json.dumps(k)}: {json.dumps(v)},\n")
        f.write('  "positions": [\n')
        for i, p in enumerate(positions):
            sep = "," if i + 1 < len(positions) else ""
            f.write("    " + json.dumps(p, separators=(",", ":")) + sep + "\n")
        f.write("  ]\n}\n")
    os.replace(tmp, args.out)

    top1 = [p["ids"][0] for p in positions]
    follow = sum(1 for i in range(n - 1) if top1[i] == tokens[i + 1])
    print(
        f"{args.out}: {n} tokens, vocab {fixture['n_vocab']}, "
        f"{args.out.stat().st_size} bytes; llama.cpp's top-1 equals the next text token "
        f"at {follow}/{n - 1} positions"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
