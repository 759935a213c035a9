#!/usr/bin/env python3
"""llama.cpp's tokenizer on fresh random text, as the reference for crates/tokenizer.

For every vocabulary llama.cpp's test vectors ship (models/ggml-vocab-*.gguf, fetched by
scripts/fetch_vocabs.sh) whose tokenizer model crates/tokenizer implements (`llama`, `gpt2`,
`gemma4`), and for the default model (scripts/fetch_model.sh), this loads the vocabulary with
llama-cpp-python 0.3.36 (`vocab_only`) and records, through llama.cpp's C API:

  * the special ids (`llama_vocab_bos/eos/eot`), `add_bos`/`add_eos`, every end-of-generation id,
    and every token attribute that is not plain NORMAL;
  * `llama_token_to_piece` of every token, with and without `special`, as a SHA-256 over
    (u32 little-endian length, bytes) per token, plus the pieces of a random sample of ids;
  * for random texts (seeded; more and one long one for the default model and the five
    vocabularies that must match): `llama_tokenize` with add_special x parse_special, and
    `llama_detokenize` of the tokens with (remove_special, unparse_special) in three settings.

Texts mix words, whitespace runs, digit runs, punctuation and contractions, scripts from Latin
to CJK and Thai, emoji with joiners and modifiers, combining marks, control characters, random
code points, and the vocabulary's own control / user-defined token texts with spaces around
them (so special-token splitting and its lstrip/rstrip rules are exercised).

Output (JSON): format "crossover-llama-cpp-tokenizer/1", generator, llama_cpp_python, seed,
vocabs: list of {name, file, n_vocab, bos, eos, eot, add_bos, add_eos, eog, attrs [[id, attr]],
pieces_sha256 {special, plain}, piece_samples [[id, hex special, hex plain]], cases: [{text,
tokens {"FF","TF","FT","TT"} (add_special, parse_special), detok {"FF","TT","FT"}
(remove_special, unparse_special) as hex of the bytes for the "TT" tokens}]}.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import random
import struct
import sys
from pathlib import Path

import gguf
import llama_cpp

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"
OUT = REPO / "crates/tokenizer/tests/fixtures/llama_cpp_tokenizer.json"
SUPPORTED_MODELS = {"llama", "gpt2", "gemma4"}
# The default model and the vocabularies that must match llama.cpp get more and longer texts.
REQUIRED = {"smollm2-135m-instruct", "llama-bpe", "llama-spm", "gpt-2", "qwen2", "phi-3"}

WORDS = ["Hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog",
         "tokenizer", "llama", "GGUF", "model", "don't", "I'm", "we've", "they'll", "it's",
         "HELLO", "camelCase", "snake_case", "x", "a", "I", "function", "return", "self"]
SPACES = [" ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", " \n ", "    ", "\u00a0", "\u3000",
          "\u2009", "\u200b", "\v", "\f"]
PUNCT = [".", ",", "!", "?", "...", "!!", "'s", "'RE", "'ve", "'LL", "'d", "'M", "\u2019s", "--",
         "(", ")", "[", "]", "{", "}", "<", ">", "\"", "'", "`", "$", "%", "^", "~", "|", "#",
         "@", "&", "*", "+", "=", "/", "\\", ";", ":", "\u2026", "\u3002", "\uff0c"]
SCRIPTS = ["\u00e9t\u00e9", "\u00fcber", "stra\u00dfe", "\u65e5\u672c\u8a9e", "\u4e2d\u6587\u5b57",
           "\ud55c\uad6d\uc5b4", "\u041f\u0440\u0438\u0432\u0435\u0442", "\u03b1\u03b2\u03b3",
           "\u05e2\u05d1\u05e8\u05d9\u05ea", "\u0627\u0644\u0639\u0631\u0628\u064a\u0629",
           "\u0939\u093f\u0928\u094d\u0926\u0940", "\u0e44\u0e17\u0e22", "\u1780\u17b6\u1793",
           "C\u1eeda Vi\u1ec7t", "\u0101\u0113\u012b"]
EMOJI = ["\U0001F680", "\U0001F44D\U0001F3FD", "\U0001F636\u200d\U0001F32B\ufe0f", "\u2705",
         "\U0001F999", "\U0001F468\u200d\U0001F469\u200d\U0001F467", "\U0001F1EB\U0001F1F7"]
ODD = ["a\u0301", "e\u0308\u0301", "\x00", "\x7f", "\x1b[0m", "\ufffd", "\u0378", "\ue000",
       "\U0001d400", "\u2581", "\u0120", "\u010a", "<0x0A>", "<s>", "</s>", "<unk>", "<|x|>"]


def random_codepoint(rng: random.Random) -> str:
    lo, hi = rng.choice([(0x20, 0x7e), (0xa0, 0x24f), (0x370, 0x52f), (0x4e00, 0x9fff),
                         (0x3040, 0x30ff), (0xac00, 0xd7a3), (0x1f300, 0x1faff),
                         (0x10000, 0x1ffff), (0x2000, 0x2bff)])
    while True:
        c = rng.randint(lo, hi)
        if not 0xd800 <= c <= 0xdfff:
            return chr(c)


def random_text(rng: random.Random, specials: list[str], length: int) -> str:
    parts: list[str] = []
    total = 0
    while total < length:
        r = rng.random()
        if r < 0.30:
            p = rng.choice(WORDS)
        elif r < 0.45:
            p = rng.choice(SPACES)
        elif r < 0.53:
            p = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12)))
        elif r < 0.63:
            p = rng.choice(PUNCT)
        elif r < 0.73:
            p = rng.choice(SCRIPTS)
        elif r < 0.78:
            p = rng.choice(EMOJI)
        elif r < 0.83:
            p = rng.choice(ODD)
        elif r < 0.90:
            p = "".join(random_codepoint(rng) for _ in range(rng.randint(1, 6)))
        elif specials:
            p = rng.choice(["", " ", "  ", "\n"]) + rng.choice(specials) + rng.choice(["", " ", "\n "])
        else:
            p = rng.choice(WORDS)
        if rng.random() < 0.5 and p and not p[0].isspace():
            p = " " + p
        parts.append(p)
        total += len(p)
    return "".join(parts)


class Vocab:
    def __init__(self, path: Path):
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        cap = len(text) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, text, len(text), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, text, len(text), buf, cap, add_special,
                                         parse_special)
        if n < 0:
            raise RuntimeError("tokenize failed")
        return list(buf[:n])

    def detokenize(self, tokens: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        arr = (llama_cpp.llama_token * max(1, len(tokens)))(*tokens)
        cap = 64 + 8 * len(tokens)
        while True:
            out = ctypes.create_string_buffer(cap)
            n = llama_cpp.llama_detokenize(self.vocab, arr, len(tokens), out, cap, remove_special,
                                           unparse_special)
            if n >= 0:
                return out.raw[:n]
            cap = -n + 1

    def piece(self, token: int, special: bool) -> bytes:
        cap = 64
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, cap, 0, special)
            if n >= 0:
                return buf.raw[:n]
            cap = -n

    def free(self):
        llama_cpp.llama_model_free(self.model)


def special_texts(path: Path) -> list[str]:
    r = gguf.GGUFReader(str(path))
    toks = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in r.fields else []
    out = [t for t, ty in zip(toks, types) if ty in (2, 3, 4)]
    # Tokens llama.cpp treats as special by their text even when typed NORMAL.
    for t in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "</s>", "<s>",
              "<|begin_of_text|>", "<|user|>", "<|assistant|>", "<end_of_turn>"]:
        if t in toks:
            out.append(t)
    return sorted(set(out))


def vocab_record(name: str, path: Path, rel: str, rng: random.Random, n_texts: int) -> dict:
    v = Vocab(path)
    try:
        n = v.n
        h_special, h_plain = hashlib.sha256(), hashlib.sha256()
        attrs = []
        eog = []
        for t in range(n):
            ps, pp = v.piece(t, True), v.piece(t, False)
            h_special.update(struct.pack("<I", len(ps)) + ps)
            h_plain.update(struct.pack("<I", len(pp)) + pp)
            a = llama_cpp.llama_vocab_get_attr(v.vocab, t)
            if a != 4:
                attrs.append([t, int(a)])
            if llama_cpp.llama_vocab_is_eog(v.vocab, t):
                eog.append(t)
        sample_ids = sorted(rng.sample(range(n), min(100, n)))
        samples = [[t, v.piece(t, True).hex(), v.piece(t, False).hex()] for t in sample_ids]
        specials = special_texts(path)
        specials = rng.sample(specials, min(12, len(specials)))
        cases = []
        for i in range(n_texts):
            long_text = n_texts >= 12 and i == n_texts - 1
            length = rng.randint(600, 900) if long_text else rng.randint(1, 80)
            text = random_text(rng, specials, length)
            b = text.encode("utf-8")
            toks = {f"{'T' if a else 'F'}{'T' if p else 'F'}": v.tokenize(b, a, p)
                    for a in (False, True) for p in (False, True)}
            detok = {f"{'T' if r else 'F'}{'T' if u else 'F'}": v.detokenize(toks["TT"], r, u).hex()
                     for r, u in ((False, False), (True, True), (False, True))}
            cases.append({"text": text, "tokens": toks, "detok": detok})

        def opt(x):
            return None if x < 0 else int(x)

        return {
            "name": name,
            "file": rel,
            "n_vocab": n,
            "bos": opt(llama_cpp.llama_vocab_bos(v.vocab)),
            "eos": opt(llama_cpp.llama_vocab_eos(v.vocab)),
            "eot": opt(llama_cpp.llama_vocab_eot(v.vocab)),
            "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(v.vocab)),
            "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(v.vocab)),
            "eog": eog,
            "attrs": attrs,
            "pieces_sha256": {"special": h_special.hexdigest(), "plain": h_plain.hexdigest()},
            "piece_samples": samples,
            "cases": cases,
        }
    finally:
        v.free()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=7_340_033)
    ap.add_argument("--texts", type=int, default=20,
                    help="random texts per required vocabulary (the last one long)")
    ap.add_argument("--texts-other", type=int, default=8,
                    help="random texts per other vocabulary (all short)")
    args = ap.parse_args()

    vocab_dir = CACHE / "vocab"
    model = CACHE / "models/smollm2-135m-instruct-q4_1.gguf"
    for p, script in [(vocab_dir, "scripts/fetch_vocabs.sh"), (model, "scripts/fetch_model.sh")]:
        if not p.exists():
            print(f"{p} is missing: run {script}", file=sys.stderr)
            return 1

    llama_cpp.llama_backend_init()
    # Silence llama.cpp's loader logging.
    noop = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(noop, ctypes.c_void_p(0))

    targets = [("smollm2-135m-instruct", model, ".cache/models/" + model.name)]
    for p in sorted(vocab_dir.glob("ggml-vocab-*.gguf")):
        kind = gguf.GGUFReader(str(p)).fields["tokenizer.ggml.model"].contents()
        if kind in SUPPORTED_MODELS:
            targets.append((p.stem.removeprefix("ggml-vocab-"), p, ".cache/vocab/" + p.name))

    rng = random.Random(args.seed)
    vocabs = []
    for name, path, rel in targets:
        n_texts = args.texts if name in REQUIRED else args.texts_other
        rec = vocab_record(name, path, rel, rng, n_texts)
        print(f"{name}: {rec['n_vocab']} tokens, {len(rec['cases'])} texts", file=sys.stderr)
        vocabs.append(rec)

    doc = {
        "format": "crossover-llama-cpp-tokenizer/1",
        "generator": "scripts/gen_tokenizer_fixtures.py",
        "llama_cpp_python": llama_cpp.__version__,
        "seed": args.seed,
        "vocabs": vocabs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n",
                        encoding="utf-8")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
