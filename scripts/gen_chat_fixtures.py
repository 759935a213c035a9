#!/usr/bin/env python3
"""Expected chat-template renderings, made by Python's jinja2 the way Hugging Face transformers
renders chat templates, as the reference for crates/tokenizer's minijinja renderer.

Templates (read from the fetched files, never typed in):
  * smollm2     the default model's `tokenizer.chat_template` (scripts/fetch_model.sh)
  * qwen2, phi3 `tokenizer.chat_template` of llama.cpp's ggml-vocab-qwen2 / -phi-3 vocab files
  * llama31, llama32, gemma2, mistral_nemo
                llama.cpp's models/templates/*.jinja (scripts/fetch_vocabs.sh fetches both)

The jinja2 environment is transformers' (`ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)` with loop controls, its `tojson` filter, `raise_exception` and
`strftime_now` globals; `strftime_now` reports a fixed instant so renderings are reproducible).
Conversations are random (seeded): roles, lengths, and contents mixing words, punctuation,
Jinja-looking text, newlines, tabs, leading/trailing spaces and non-ASCII text. Some are invalid
for the template (e.g. a system message for Gemma 2) and expect the template's own error.

Output (JSON): format "crossover-chat-fixtures/1", generator, jinja2 version, fixed_time (Unix
seconds, UTC), templates {name: {source, origin, bos_token, eos_token}}, cases: list of
{template, messages [{role, content}], add_generation_prompt, expected (string or null),
error (the template's exception message or null)}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
from pathlib import Path

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache"
OUT = REPO / "crates/tokenizer/tests/fixtures/chat_templates.json"


def gguf_str(path: Path, key: str) -> str:
    r = gguf.GGUFReader(str(path))
    return r.fields[key].contents()


def gguf_token(path: Path, key: str) -> str:
    r = gguf.GGUFReader(str(path))
    tid = int(r.fields[key].contents())
    return r.fields["tokenizer.ggml.tokens"].contents()[tid]


def make_env(fixed_time: int) -> jinja2.Environment:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.fromtimestamp(fixed_time, tz=datetime.timezone.utc).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


WORDS = ["hello", "world", "the", "model", "answer", "question", "Paris", "is", "a", "capital",
         "why", "how", "code", "fn", "main()", "x", "42", "3.14", "don't", "I'm", "it's", "OK"]
ODD = ["{{ x }}", "{% if %}", "{#", "#}", "<|im_end|>", "<s>", "</s>", '"quoted"', "'single'",
       "\\", "\\n", "&", "<b>", "{", "}", "%", "\t", "\n", "\n\n", "  ", "\u00e9t\u00e9",
       "\u65e5\u672c\u8a9e", "\U0001F680", "\u043f\u0440\u0438\u0432\u0435\u0442", "a\u0301",
       "\u200d", "\u00a0"]


def random_content(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 14)):
        parts.append(rng.choice(WORDS) if rng.random() < 0.65 else rng.choice(ODD))
    text = " ".join(parts) if rng.random() < 0.7 else "".join(parts)
    if rng.random() < 0.25:
        text = rng.choice([" ", "  ", "\n", " \n "]) + text
    if rng.random() < 0.25:
        text = text + rng.choice([" ", "\n", "\t", "  \n"])
    if rng.random() < 0.05:
        text = ""
    return text


def random_conversation(rng: random.Random, valid: bool) -> list[dict]:
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": random_content(rng)})
    turns = rng.randint(1, 5)
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": random_content(rng)})
    if not valid:
        # Break the alternation the stricter templates enforce.
        k = rng.randrange(len(msgs) + 1)
        msgs.insert(k, {"role": rng.choice(["user", "assistant"]), "content": random_content(rng)})
    return msgs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=20260530)
    ap.add_argument("--per-template", type=int, default=12)
    args = ap.parse_args()

    model = CACHE / "models/smollm2-135m-instruct-q4_1.gguf"
    vocab = CACHE / "vocab"
    tdir = vocab / "templates"
    for p, script in [(model, "scripts/fetch_model.sh"), (vocab, "scripts/fetch_vocabs.sh")]:
        if not p.exists():
            print(f"{p} is missing: run {script}", file=sys.stderr)
            return 1
    llama_bpe = vocab / "ggml-vocab-llama-bpe.gguf"
    templates = {
        "smollm2": (gguf_str(model, "tokenizer.chat_template"), str(model.relative_to(REPO)),
                    gguf_token(model, "tokenizer.ggml.bos_token_id"),
                    gguf_token(model, "tokenizer.ggml.eos_token_id")),
    }
    for name, f in [("qwen2", "ggml-vocab-qwen2.gguf"), ("phi3", "ggml-vocab-phi-3.gguf")]:
        p = vocab / f
        templates[name] = (gguf_str(p, "tokenizer.chat_template"), f"llama.cpp models/{f}",
                           gguf_token(p, "tokenizer.ggml.bos_token_id"),
                           gguf_token(p, "tokenizer.ggml.eos_token_id"))
    llama_bos = gguf_token(llama_bpe, "tokenizer.ggml.bos_token_id")
    llama_eos = gguf_token(llama_bpe, "tokenizer.ggml.eos_token_id")
    for name, f, bos, eos in [
        ("llama31", "meta-llama-Llama-3.1-8B-Instruct.jinja", llama_bos, llama_eos),
        ("llama32", "meta-llama-Llama-3.2-3B-Instruct.jinja", llama_bos, llama_eos),
        ("gemma2", "google-gemma-2-2b-it.jinja", "<bos>", "<eos>"),
        ("mistral_nemo", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>"),
    ]:
        templates[name] = ((tdir / f).read_text(encoding="utf-8"), f"llama.cpp models/templates/{f}",
                           bos, eos)

    # Not a model's template: a probe of the tojson filter's options against jinja2's output.
    templates["tojson_probe"] = (
        "{% for m in messages %}{{ m | tojson }}|{{ m.content | tojson(ensure_ascii=True) }}|"
        "{{ m | tojson(sort_keys=True, separators=(',', ':')) }}|{{ loop.index0 }}\n{% endfor %}"
        "{{ messages | tojson(indent=2) }}{% if add_generation_prompt %}{{ [1, 2.5, none, true] "
        "| tojson }}{% endif %}",
        "scripts/gen_chat_fixtures.py", "<s>", "</s>")

    rng = random.Random(args.seed)
    fixed_time = rng.randint(946684800, 1893456000)
    env = make_env(fixed_time)
    cases = []
    for name, (source, _origin, bos, eos) in templates.items():
        tmpl = env.from_string(source)
        for i in range(args.per_template):
            valid = i < args.per_template - 3
            messages = random_conversation(rng, valid)
            agp = rng.random() < 0.6
            expected, error = None, None
            try:
                expected = tmpl.render(messages=messages, add_generation_prompt=agp, bos_token=bos,
                                       eos_token=eos, tools=None, documents=None)
            except jinja2.exceptions.TemplateError as e:
                error = str(e)
            cases.append({"template": name, "messages": messages, "add_generation_prompt": agp,
                          "expected": expected, "error": error})

    doc = {
        "format": "crossover-chat-fixtures/1",
        "generator": "scripts/gen_chat_fixtures.py",
        "jinja2": jinja2.__version__,
        "seed": args.seed,
        "fixed_time": fixed_time,
        "templates": {n: {"source": s, "origin": o, "bos_token": b, "eos_token": e}
                      for n, (s, o, b, e) in templates.items()},
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    n_err = sum(1 for c in cases if c["error"])
    print(f"wrote {args.out}: {len(cases)} cases ({n_err} template errors), "
          f"{len(templates)} templates", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
