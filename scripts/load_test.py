#!/usr/bin/env python3
"""Load test of `crossover serve` on loopback: N concurrent streaming clients against the CPU
backend with the default model (SmolLM2-135M-Instruct Q4_1).

Starts the server (127.0.0.1, a free port), measures one streaming request alone (the
single-stream rate), then runs N clients at once, each asking for exactly --max-tokens tokens
(ignore_eos). Passes when every request completes with the tokens it asked for, with zero errors,
and the aggregate generated tok/s is at least --min-speedup times the single-stream rate.
Bounded: every request has a timeout and the whole run a deadline.

    python3 scripts/load_test.py [--binary target/release/crossover] [--clients 64]

Prints the figures and one JSON line (`RESULT {...}`); exit status 1 on failure.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_request(base, model, prompt, max_tokens, timeout):
    """One streaming chat request over raw HTTP; returns (tokens, chunks, seconds, error)."""
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": 1,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    t0 = time.perf_counter()
    usage, chunks, done = None, 0, False
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return 0, chunks, time.perf_counter() - t0, obj["error"].get("message")
                if obj.get("usage"):
                    usage = obj["usage"]
                if obj.get("choices"):
                    chunks += 1
    except Exception as e:  # noqa: BLE001 - reported
        return 0, chunks, time.perf_counter() - t0, repr(e)
    dt = time.perf_counter() - t0
    if not done or usage is None:
        return 0, chunks, dt, "stream ended without usage and [DONE]"
    return usage["completion_tokens"], chunks, dt, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(REPO, "target/release/crossover"))
    ap.add_argument("--model", default=os.path.join(REPO, ".cache/models/smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--min-speedup", type=float, default=3.0)
    ap.add_argument("--deadline", type=float, default=600.0)
    a = ap.parse_args()
    if not os.path.exists(a.model):
        sys.exit(f"model {a.model} is missing: run scripts/fetch_model.sh")
    if not os.path.exists(a.binary):
        sys.exit(f"{a.binary} is missing: cargo build --release -p crossover")

    port = free_port()
    cmd = [a.binary, "serve", "--model", a.model, "--host", "127.0.0.1", "--port", str(port),
           "-c", str(a.ctx), "--parallel", str(a.clients), "--alias", "m"]
    if a.threads:
        cmd += ["-t", str(a.threads)]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if server.poll() is not None or time.time() - t0 > 120:
                sys.exit("server did not start: " + (server.stderr.read() if server.stderr else ""))
            time.sleep(0.2)

        prompt = "Write a short story about a lighthouse keeper."
        # Warm-up, then the single-stream rate.
        stream_request(base, "m", prompt, 8, 120)
        n1, _, dt1, err1 = stream_request(base, "m", prompt, a.max_tokens, 120)
        if err1:
            sys.exit(f"single stream failed: {err1}")
        single = n1 / dt1
        print(f"single stream: {n1} tokens in {dt1:.2f} s = {single:.1f} tok/s", flush=True)

        results = [None] * a.clients
        deadline = time.time() + a.deadline

        def client(i):
            results[i] = stream_request(base, "m", f"{prompt} Number {i}.", a.max_tokens,
                                        max(1.0, deadline - time.time()))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        t_start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.time()))
        wall = time.perf_counter() - t_start
        errors = [r[3] for r in results if r is None or r[3]]
        short = [i for i, r in enumerate(results) if r and not r[3] and r[0] != a.max_tokens]
        total = sum(r[0] for r in results if r and not r[3])
        aggregate = total / wall
        lat = sorted(r[2] for r in results if r and not r[3])
        print(f"{a.clients} concurrent streams: {total} tokens in {wall:.2f} s = {aggregate:.1f} tok/s "
              f"({aggregate / single:.2f}x single); errors {len(errors)}; short {len(short)}; "
              f"request time p50 {lat[len(lat) // 2] if lat else 0:.2f} s, max {lat[-1] if lat else 0:.2f} s",
              flush=True)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            metrics = r.read().decode()
        ttft = [l for l in metrics.splitlines() if l.startswith("crossover_time_to_first_token_seconds_")]
        print("\n".join(l for l in ttft if "_sum" in l or "_count" in l))
        ok = not errors and not short and aggregate >= a.min_speedup * single
        print("RESULT " + json.dumps({
            "clients": a.clients, "max_tokens": a.max_tokens, "single_tok_s": round(single, 2),
            "aggregate_tok_s": round(aggregate, 2), "speedup": round(aggregate / single, 2),
            "errors": len(errors), "short": len(short), "wall_s": round(wall, 2), "pass": ok,
        }))
        if errors:
            print("first errors:", errors[:3])
        return 0 if ok else 1
    finally:
        server.terminate()
        try:
            code = server.wait(timeout=60)
            print(f"server exited with {code} after SIGTERM")
        except subprocess.TimeoutExpired:
            server.kill()
            print("server did not stop within 60 s of SIGTERM")


if __name__ == "__main__":
    sys.exit(main())
