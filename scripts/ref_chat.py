#!/usr/bin/env python3
"""llama.cpp's greedy chat answers (llama-cpp-python 0.3.36), as a reference for the engine.

For each question, with the system message "You are a helpful assistant.":
  * `create_chat_completion` (temperature 0, top_k 1, repeat_penalty 1) gives the answer text
    exactly as a llama-cpp-python user would see it;
  * the same prompt, rendered with the model's own chat template by llama-cpp-python's Jinja
    formatter and tokenized by llama.cpp, is decoded greedily token by token (argmax of the
    logits) until the end-of-generation token, which gives the answer's token ids.
Both must agree on the text; the fixture keeps the rendered prompt, its token ids, the answer
token ids and the text, so a test can compare the engine's greedy tokens one by one.

Fixture layout (JSON): format "crossover-ref-chat/1", generator, llama_cpp_python,
model {file (repo-relative path), name, sha256, size_bytes}, max_tokens, cases: list of
{system, user, prompt_text, prompt_tokens, answer_tokens, answer_text, chat_completion_text,
stopped_on}
(stopped_on: "eog" when an end-of-generation token ended it, "max_tokens" otherwise; the
end-of-generation token itself is not in answer_tokens).
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
SYSTEM = "You are a helpful assistant."
QUESTIONS = [
    "What is the capital of France?",
    "Which planet is the largest in our solar system?",
]


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", type=Path, help="fixture to write (JSON)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import llama_cpp
    from llama_cpp import llama_chat_format

    llm = llama_cpp.Llama(
        model_path=str(args.model),
        n_ctx=1024,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        flash_attn=False,
        verbose=False,
    )
    template = llm.metadata.get("tokenizer.chat_template")
    if template is None:
        sys.exit("error: the model has no tokenizer.chat_template")
    vocab = llm._model
    eos_text = vocab.token_get_text(llm.token_eos())
    bos_text = vocab.token_get_text(llm.token_bos())
    formatter = llama_chat_format.Jinja2ChatFormatter(
        template=template, eos_token=eos_text, bos_token=bos_text
    )
    n_vocab = llm.n_vocab()

    cases = []
    for q in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        resp = llm.create_chat_completion(
            messages=messages,
            temperature=0.0,
            top_k=1,
            top_p=1.0,
            min_p=0.0,
            repeat_penalty=1.0,
            max_tokens=args.max_tokens,
            seed=0,
        )
        chat_text = resp["choices"][0]["message"]["content"]

        prompt_text = formatter(messages=messages).prompt
        prompt_tokens = llm.tokenize(prompt_text.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(prompt_tokens)
        answer: list[int] = []
        stopped_on = "max_tokens"
        for _ in range(args.max_tokens):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
            tok = int(logits.argmax())
            if llama_cpp.llama_vocab_is_eog(vocab.vocab, tok):
                stopped_on = "eog"
                break
            answer.append(tok)
            llm.eval([tok])
        answer_text = llm.detokenize(answer).decode("utf-8", errors="replace")
        if answer_text.strip() != chat_text.strip():
            print(
                f"warning: token-by-token greedy text differs from create_chat_completion:\n"
                f"  {answer_text!r}\n  {chat_text!r}",
                file=sys.stderr,
            )
        print(f"Q: {q}\nA: {chat_text}\n")
        cases.append(
            {
                "system": SYSTEM,
                "user": q,
                "prompt_text": prompt_text,
                "prompt_tokens": [int(t) for t in prompt_tokens],
                "answer_tokens": answer,
                "answer_text": answer_text,
                "chat_completion_text": chat_text,
                "stopped_on": stopped_on,
            }
        )

    if args.out:
        fixture = {
            "format": "crossover-ref-chat/1",
            "generator": "scripts/ref_chat.py",
            "llama_cpp_python": llama_cpp.__version__,
            "model": {
                "file": repo_relative(args.model),
                "name": args.model.name,
                "sha256": sha256_file(args.model),
                "size_bytes": args.model.stat().st_size,
            },
            "max_tokens": args.max_tokens,
            "cases": cases,
        }
        tmp = args.out.with_suffix(args.out.suffix + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
        os.replace(tmp, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
