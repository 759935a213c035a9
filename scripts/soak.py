#!/usr/bin/env python3
"""Soak test of `crossover serve` on loopback: a bounded run with a mixed load.

Starts the server (127.0.0.1, a free port) and runs --clients concurrent clients for --minutes
(default 10). Each request is drawn at random (seeded):
  - 1 in 20 malformed (bad JSON, wrong types, unknown model, prompt over the context, too many
    stop strings, n > 1, ...): must get its 4xx in OpenAI's error shape;
  - 1 in 10 a streaming request the client abandons after a few chunks (cancellation);
  - the rest valid: short or long prompt, streaming or not, 8-64 new tokens: must complete with
    usage (and `data: [DONE]` when streaming), or be refused as overloaded (429 with
    Retry-After; counted apart: the server's answer to more load than it can serve in time).
Meanwhile the server's resident memory (VmRSS) is sampled every --rss-interval seconds; after
the warm-up (--warmup-minutes) a least-squares line is fitted (MiB per minute; a leak shows as
a slope). At the end, once the clients are done, /metrics must show 0 KV blocks in use on
every backend; then SIGTERM, and the server must exit 0.

    python3 scripts/soak.py [--binary target/release/crossover] [--minutes 10] [--clients 8]

Prints a table and one JSON line (`RESULT {...}`); exit status 1 if a valid request failed, a
malformed one got the wrong answer, KV blocks stayed in use, or the server did not exit cleanly.
"""

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORDS = ("the quick brown fox jumps over a lazy dog near river bank while seven wise owls "
         "watch quietly from old oak trees under bright silver moonlight").split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def slope_per_min(samples):
    """Least-squares slope of (seconds, KiB) samples, in MiB per minute."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mx = sum(t for t, _ in samples) / n
    my = sum(v for _, v in samples) / n
    sxx = sum((t - mx) ** 2 for t, _ in samples)
    if sxx == 0:
        return None
    sxy = sum((t - mx) * (v - my) for t, v in samples)
    return sxy / sxx * 60 / 1024


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes = {}
        self.ttft = []          # seconds, streaming requests, client side
        self.server_ttft = []   # seconds, from `timings` of whole responses
        self.tokens = 0
        self.failures = []

    def add(self, outcome, detail=None):
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if detail and len(self.failures) < 20:
                self.failures.append(f"{outcome}: {detail}")


def prompt_text(rng, long):
    n = rng.randint(300, 600) if long else rng.randint(3, 20)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def malformed(rng, model, ctx):
    """A bad request and the status it must get."""
    kind = rng.randrange(8)
    msg = [{"role": "user", "content": "hi"}]
    if kind == 0:
        return "chat", b'{"model": "%s", "messages": [' % model.encode(), 400
    if kind == 1:
        return "chat", json.dumps({"model": model, "messages": "hello"}).encode(), 400
    if kind == 2:
        return "chat", json.dumps({"model": "no-such-model", "messages": msg}).encode(), 404
    if kind == 3:
        return "chat", json.dumps({"model": model, "messages": msg, "temperature": "hot"}).encode(), 400
    if kind == 4:
        return "completions", json.dumps({"model": model, "prompt": "x " * (ctx + 100)}).encode(), 400
    if kind == 5:
        return "chat", json.dumps({"model": model, "messages": msg, "stop": [f"s{i}" for i in range(100)]}).encode(), 400
    if kind == 6:
        return "chat", json.dumps({"model": model, "messages": msg, "n": 3}).encode(), 400
    return "completions", json.dumps({"model": model, "prompt": [1, 2, -7], "max_tokens": -1}).encode(), 400


def post(port, path, body, timeout):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    return c, c.getresponse()


def one_request(rng, port, model, ctx, stats, timeout):
    r = rng.random()
    if r < 0.05:
        ep, body, want = malformed(rng, model, ctx)
        try:
            c, resp = post(port, f"/v1/{ep if ep == 'completions' else 'chat/completions'}", body, timeout)
            data = resp.read()
            c.close()
            err = json.loads(data).get("error", {})
            if resp.status == want and err.get("message") and err.get("type"):
                stats.add("malformed: expected 4xx")
            else:
                stats.add("malformed: WRONG answer", f"{resp.status} {data[:200]!r}")
        except Exception as e:  # noqa: BLE001 - reported
            stats.add("malformed: WRONG answer", repr(e))
        return
    cancel = r < 0.15
    long = rng.random() < 0.3
    stream = cancel or rng.random() < 0.5
    max_tokens = rng.randint(8, 64)
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": rng.choice([0, 0.7, 1.0]),
        "seed": rng.randrange(1 << 30),
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    chat = rng.random() < 0.7
    if chat:
        body["messages"] = [{"role": "user", "content": prompt_text(rng, long)}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt_text(rng, long)
        path = "/v1/completions"
    label = ("long" if long else "short") + (" stream" if stream else " whole")
    t0 = time.perf_counter()
    try:
        c, resp = post(port, path, json.dumps(body).encode(), timeout)
        if resp.status != 200:
            data = resp.read()
            c.close()
            if resp.status == 429 and resp.getheader("Retry-After"):
                # Overload is refused by design (queue full or no KV space in time), with a
                # Retry-After: counted apart, not as a failure.
                stats.add(f"valid {label}: refused 429 (overloaded)")
            else:
                stats.add(f"valid {label}: FAILED", f"{resp.status} {data[:200]!r}")
            return
        if not stream:
            data = json.loads(resp.read())
            c.close()
            u = data["usage"]
            if data["choices"][0]["finish_reason"] not in ("stop", "length") or u["completion_tokens"] < 1:
                stats.add(f"valid {label}: FAILED", json.dumps(data)[:200])
                return
            with stats.lock:
                stats.tokens += u["completion_tokens"]
                stats.server_ttft.append(data["timings"]["time_to_first_token_ms"] / 1e3)
            stats.add(f"valid {label}: ok")
            return
        first = None
        usage = None
        done = False
        chunks = 0
        stop_after = rng.randint(1, 4) if cancel else None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            d = line[6:]
            if d == "[DONE]":
                done = True
                break
            obj = json.loads(d)
            if "error" in obj:
                stats.add(f"valid {label}: FAILED", d[:200])
                c.close()
                return
            ch = obj.get("choices") or []
            if ch and (ch[0].get("delta", {}).get("content") or ch[0].get("text")):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
            if obj.get("usage"):
                usage = obj["usage"]
            if stop_after is not None and chunks >= stop_after:
                break
        if cancel:
            # Closing the socket mid-stream is the client going away.
            c.sock.shutdown(socket.SHUT_RDWR)
            c.close()
            stats.add("cancelled by client")
            return
        c.close()
        if not done or usage is None:
            stats.add(f"valid {label}: FAILED", "stream ended without usage and [DONE]")
            return
        with stats.lock:
            stats.tokens += usage["completion_tokens"]
            if first is not None:
                stats.ttft.append(first)
        stats.add(f"valid {label}: ok")
    except Exception as e:  # noqa: BLE001 - reported
        stats.add(f"valid {label}: FAILED", repr(e))


def metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def kv_used(text):
    used = {}
    for line in text.splitlines():
        m = re.match(r'crossover_kv_blocks_used\{backend="([^"]+)"\}\s+(\S+)', line)
        if m:
            used[m.group(1)] = float(m.group(2))
    return used


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(REPO, "target/release/crossover"))
    ap.add_argument("--model", default=os.path.join(REPO, ".cache/models/smollm2-135m-instruct-q4_1.gguf"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warmup-minutes", type=float, default=None,
                    help="memory samples before this are not fitted (default: a fifth of the run)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rss-interval", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--max-slope", type=float, default=None,
                    help="fail if the fitted RSS slope exceeds this many MiB/min (default: report only)")
    a = ap.parse_args()

    port = free_port()
    model_id = "soak"
    cmd = [a.binary, "serve", "-m", a.model, "-a", model_id, "--host", "127.0.0.1",
           "--port", str(port), "-c", str(a.ctx), "--parallel", str(a.parallel)]
    if a.threads:
        cmd += ["-t", str(a.threads)]
    log_path = os.path.join(REPO, "target", "soak-server.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    log = open(log_path, "w")
    srv = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    print(f"server: {' '.join(cmd)} (pid {srv.pid}, log {log_path})", flush=True)
    t_start = time.time()
    while True:
        if srv.poll() is not None:
            sys.exit(f"server exited with {srv.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.time() - t_start > 120:
            srv.kill()
            sys.exit("server did not become healthy in 120 s")
        time.sleep(0.2)

    stats = Stats()
    duration = a.minutes * 60
    warmup = (a.warmup_minutes * 60) if a.warmup_minutes is not None else duration / 5
    t0 = time.time()
    deadline = t0 + duration
    rss = []
    stop_sampling = threading.Event()

    def sampler():
        while not stop_sampling.is_set():
            v = rss_kib(srv.pid)
            if v is not None:
                rss.append((time.time() - t0, v))
            stop_sampling.wait(a.rss_interval)

    def client(i):
        rng = random.Random(a.seed * 1000 + i)
        while time.time() < deadline:
            one_request(rng, port, model_id, a.ctx, stats, a.request_timeout)

    threads = [threading.Thread(target=sampler, daemon=True)]
    threads += [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    last_report = t0
    while any(t.is_alive() for t in threads[1:]):
        time.sleep(1)
        if time.time() - last_report >= 60:
            last_report = time.time()
            with stats.lock:
                n = sum(stats.outcomes.values())
            print(f"  {int(time.time() - t0)} s: {n} requests, RSS {rss[-1][1] / 1024:.1f} MiB" if rss else "", flush=True)
    wall = time.time() - t0
    stop_sampling.set()
    crashed = srv.poll() is not None

    # Cancelled sequences are freed before the actor's next step; give it a moment.
    used = {}
    for _ in range(50):
        try:
            used = kv_used(metrics(port))
        except Exception:  # noqa: BLE001 - reported below
            used = {"unreachable": -1}
        if used and all(v == 0 for v in used.values()):
            break
        time.sleep(0.2)
    srv.send_signal(signal.SIGTERM)
    try:
        code = srv.wait(timeout=60)
    except subprocess.TimeoutExpired:
        srv.kill()
        code = "killed after 60 s"
    log.close()

    after = [(t, v) for t, v in rss if t >= warmup]
    slope = slope_per_min(after)
    ttft50, ttft99 = percentile(stats.ttft, 50), percentile(stats.ttft, 99)
    sttft50, sttft99 = percentile(stats.server_ttft, 50), percentile(stats.server_ttft, 99)
    total = sum(stats.outcomes.values())
    failed = sum(v for k, v in stats.outcomes.items() if "FAILED" in k or "WRONG" in k)

    print(f"\n{wall / 60:.1f} min, {a.clients} clients, {total} requests\n")
    print("| outcome | requests |\n|---|---|")
    for k in sorted(stats.outcomes):
        print(f"| {k} | {stats.outcomes[k]} |")
    fmt = lambda x: "-" if x is None else f"{x * 1e3:.0f} ms"  # noqa: E731
    print("\n| figure | value |\n|---|---|")
    print(f"| TTFT p50 / p99 (streaming, client side) | {fmt(ttft50)} / {fmt(ttft99)} |")
    print(f"| TTFT p50 / p99 (whole responses, server timings) | {fmt(sttft50)} / {fmt(sttft99)} |")
    print(f"| generated tokens | {stats.tokens} |")
    print(f"| aggregate generation rate | {stats.tokens / wall:.1f} tok/s |")
    if rss:
        print(f"| RSS first / max / last | {rss[0][1] / 1024:.1f} / {max(v for _, v in rss) / 1024:.1f} / {rss[-1][1] / 1024:.1f} MiB |")
    print(f"| RSS slope after {warmup / 60:.1f} min warm-up ({len(after)} samples) | "
          + ("-" if slope is None else f"{slope:+.3f} MiB/min") + " |")
    print(f"| KV blocks used at the end | {used} |")
    print(f"| server exit | {code} |")
    if stats.failures:
        print("\nfirst failures:")
        for f in stats.failures:
            print("  " + f)
    ok = (failed == 0 and not crashed and used and all(v == 0 for v in used.values())
          and code == 0 and (a.max_slope is None or slope is None or slope <= a.max_slope))
    print("RESULT " + json.dumps({
        "ok": ok, "minutes": round(wall / 60, 2), "clients": a.clients, "requests": total,
        "outcomes": stats.outcomes, "ttft_p50_s": ttft50, "ttft_p99_s": ttft99,
        "server_ttft_p50_s": sttft50, "server_ttft_p99_s": sttft99,
        "tokens": stats.tokens, "tok_per_s": stats.tokens / wall,
        "rss_kib": rss, "rss_slope_mib_per_min": slope, "kv_blocks_used_end": used,
        "exit": code,
    }))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
