#!/usr/bin/env python3
"""Drives a running `crossover` server with the official `openai` Python client (PyPI `openai`).

Run by crates/server/tests/openai_client.rs, which starts the server in-process on the real CPU
backend with the default model (SmolLM2-135M-Instruct Q4_1) and passes its address. Every check
prints one line; any failure makes the exit status 1.

    python3 openai_client.py --base-url http://127.0.0.1:PORT --api-key KEY --model ID --ctx N
"""

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request

import openai

FAILURES = []


def check(name, cond, detail=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not cond:
        FAILURES.append(name)


def http(base, path, body=None, key=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def health(base):
    status, _, body = http(base, "/health")
    return status, json.loads(body)


def metric(base, key, name):
    _, _, text = http(base, "/metrics", key=key)
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


SYSTEM = "You are a helpful assistant."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ctx", type=int, required=True)
    a = ap.parse_args()
    base = a.base_url.rstrip("/")
    client = openai.OpenAI(base_url=base + "/v1", api_key=a.api_key, max_retries=0, timeout=120)

    # Models.
    models = client.models.list()
    check("models lists the model", [m.id for m in models.data] == [a.model], str([m.id for m in models.data]))

    # Non-streaming chat, with the route headers.
    raw = client.chat.completions.with_raw_response.create(
        model=a.model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=48,
    )
    chat = raw.parse()
    answer = chat.choices[0].message.content
    # Not "Paris": its first token is a near-tie on AVX-512 (crates/cli/tests/chat_answers.rs).
    check("chat answer is non-empty text", bool(answer and answer.strip()), repr(answer))
    check("chat finish_reason", chat.choices[0].finish_reason in ("stop", "length"), chat.choices[0].finish_reason)
    u = chat.usage
    check("chat usage", u.prompt_tokens > 10 and u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens, str(u))
    check("x-crossover-backend header", raw.headers.get("x-crossover-backend") == "cpu", str(raw.headers.get("x-crossover-backend")))
    check("x-crossover-route-reason header", bool(raw.headers.get("x-crossover-route-reason")), str(raw.headers.get("x-crossover-route-reason")))

    # Streaming chat with a final usage chunk.
    stream = client.chat.completions.create(
        model=a.model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which planet is the largest in our solar system?"}],
        temperature=0,
        max_tokens=48,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, n_chunks = "", None, None, 0
    for chunk in stream:
        n_chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                text += c.delta.content
            if c.finish_reason:
                finish = c.finish_reason
    check("streamed chat names Jupiter", "Jupiter" in text, repr(text))
    check("streamed chat has many chunks", n_chunks > 5, str(n_chunks))
    check("streamed chat finish_reason", finish in ("stop", "length"), str(finish))
    check("streamed usage chunk", usage is not None and usage.completion_tokens > 0, str(usage))

    # Text completion: streamed and whole agree (greedy).
    prompt = "The three primary colors are"
    whole = client.completions.create(model=a.model, prompt=prompt, max_tokens=16, temperature=0)
    parts = client.completions.create(model=a.model, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in parts if c.choices)
    check("completion text", len(whole.choices[0].text) > 0 and whole.usage.completion_tokens == 16, repr(whole.choices[0].text))
    check("completion streamed == whole", streamed == whole.choices[0].text, f"{streamed!r} vs {whole.choices[0].text!r}")
    check("completion finish_reason length", whole.choices[0].finish_reason == "length", whole.choices[0].finish_reason)

    # Stop strings: generation ends before the stop string (taken from the model's own answer).
    words = whole.choices[0].text.split()
    stop = words[len(words) // 2] if words else "x"
    cut = client.completions.create(model=a.model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    want = whole.choices[0].text[: whole.choices[0].text.find(stop)]
    check("stop string trims", cut.choices[0].text == want and cut.choices[0].finish_reason == "stop", f"{stop!r}: {cut.choices[0].text!r}")

    # Seeds: same seed, same sampled text.
    def sampled(seed):
        r = client.completions.create(model=a.model, prompt="Once upon a time", max_tokens=24, temperature=1.0, seed=seed)
        return r.choices[0].text
    s1, s2 = sampled(7), sampled(7)
    check("same seed same output", s1 == s2, f"{s1!r} / {s2!r}")

    # Concurrent streams all complete.
    results = {}
    def worker(i):
        try:
            st = client.chat.completions.create(
                model=a.model, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                max_tokens=12, temperature=0, stream=True)
            results[i] = sum(1 for c in st if c.choices and c.choices[0].delta.content)
        except Exception as e:  # noqa: BLE001 - reported as a failure below
            results[i] = repr(e)
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    check("4 concurrent streams complete", all(isinstance(v, int) and v > 0 for v in results.values()) and len(results) == 4, str(results))

    # A client that disconnects mid-stream: its sequence stops and its KV blocks come back.
    st = client.chat.completions.create(
        model=a.model, messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
    it = iter(st)
    for _ in range(4):
        next(it)
    _, h = health(base)
    used_during = h["backends"][0]["kv_blocks_used"]
    check("KV blocks in use while streaming", used_during > 0, str(used_during))
    st.close()
    deadline, freed = time.time() + 15, False
    while time.time() < deadline:
        _, h = health(base)
        b = h["backends"][0]
        if b["kv_blocks_used"] == 0 and b["queue_depth"] == 0:
            freed = True
            break
        time.sleep(0.05)
    check("disconnect frees the KV blocks", freed, json.dumps(h["backends"][0]))
    t1 = metric(base, a.api_key, "crossover_tokens_generated_total")
    time.sleep(1.0)
    t2 = metric(base, a.api_key, "crossover_tokens_generated_total")
    check("disconnected stream stops generating", t1 is not None and t1 == t2, f"{t1} -> {t2}")

    # A prompt over the context: clean 400.
    try:
        client.completions.create(model=a.model, prompt="hello " * (a.ctx + 50), max_tokens=4)
        check("over-context prompt is refused", False, "no error")
    except openai.BadRequestError as e:
        check("over-context prompt is refused with 400", e.status_code == 400 and e.code == "context_length_exceeded", f"{e.status_code} {e.code} {e.message}")

    # A bad API key: 401.
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong-key", max_retries=0)
    try:
        bad.models.list()
        check("bad API key is refused", False, "no error")
    except openai.AuthenticationError as e:
        check("bad API key is refused with 401", e.status_code == 401, str(e.status_code))

    # Unknown model: 404.
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        check("unknown model is refused", False, "no error")
    except openai.NotFoundError as e:
        check("unknown model is refused with 404", e.status_code == 404, str(e.status_code))

    # Bad sampling parameter: 400 naming it.
    try:
        client.chat.completions.create(model=a.model, messages=[{"role": "user", "content": "hi"}], top_p=3.0, max_tokens=2)
        check("bad top_p is refused", False, "no error")
    except openai.BadRequestError as e:
        check("bad top_p is refused with 400 naming it", e.status_code == 400 and e.param == "top_p", f"{e.status_code} {e.param}")

    # Bad JSON: 400 in OpenAI's error shape.
    status, _, body = http(base, "/v1/chat/completions", key=a.api_key, raw=b"{not json")
    err = json.loads(body).get("error", {})
    check("bad JSON is a 400 error object", status == 400 and err.get("type") == "invalid_request_error", f"{status} {body[:120]}")

    # Metrics.
    _, _, text = http(base, "/metrics", key=a.api_key)
    for name in ["crossover_time_to_first_token_seconds_bucket", "crossover_inter_token_seconds_bucket",
                 "crossover_tokens_generated_total", "crossover_queue_depth{", "crossover_kv_blocks_used{",
                 "crossover_kv_blocks_total{", "crossover_requests_total{"]:
        check(f"metrics has {name}", name in text)
    status, _, _ = http(base, "/metrics")
    check("metrics need the key", status == 401, str(status))
    status, hb = health(base)
    check("health ok", status == 200 and hb["status"] == "ok", str(hb))

    print(f"{len(FAILURES)} failures" + (": " + ", ".join(FAILURES) if FAILURES else ""))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
