#!/usr/bin/env python3
"""A/B of `crossover` binaries under the load test, alternating A, B, A, B... in one
invocation, so that the shared machine's drift (other builds, the cores' speed moving by ~25 %
from minute to minute) lands on every side alike.

Each round runs `scripts/load_test.py --binary X --runs R` once per binary (the order inside a
round is reversed every other round: A B, B A, A B, ...), and prints every run's single-stream
rate, aggregate and ratio with the time of day and the load average, then a summary per binary
(min / median / max of the ratio and the aggregate).

    python3 scripts/load_ab.py --a OLD_BINARY --b NEW_BINARY [--c THIRD] [--rounds 4] [--runs 1] [-- LOAD_TEST_ARGS]

Extra arguments after `--` go to load_test.py unchanged (e.g. `--single-reps 5`).

`--priority` (Linux, as root) runs each load test (its server and clients) in a new session
whose scheduler autogroup gets nice -20, and at nice -20 inside it: other users' builds on the
same cores then take little from the measured run, which approximates a quiet machine (with
autogroups on, a plain `nice` only ranks processes within one session). Without it, a run on
the shared build machine measures whatever the other builds leave over.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raise_priority():
    """In the child, after its new session began: the session's autogroup and the process at
    nice -20 (the children inherit both)."""
    with open("/proc/self/autogroup", "w") as f:
        f.write("-20")
    os.nice(-20)


def one(binary, runs, extra, priority):
    """Run the load test once; returns its RESULT runs (or None) and the exit status."""
    cmd = [sys.executable, os.path.join(REPO, "scripts/load_test.py"), "--binary", binary,
           "--runs", str(runs)] + extra
    kw = {"start_new_session": True, "preexec_fn": raise_priority} if priority else {}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])["runs"], p.returncode
    sys.stderr.write(p.stdout[-2000:] + p.stderr[-2000:])
    return None, p.returncode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="baseline binary")
    ap.add_argument("--b", required=True, help="new binary")
    ap.add_argument("--c", help="a third binary (optional)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--runs", type=int, default=1, help="load-test runs per server start")
    ap.add_argument("--priority", action="store_true",
                    help="run each load test in its own autogroup at nice -20 (see above)")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    extra = [x for x in a.rest if x != "--"]
    bins = {"A": a.a, "B": a.b}
    if a.c:
        bins["C"] = a.c
    got = {name: [] for name in bins}
    for rnd in range(a.rounds):
        order = list(bins) if rnd % 2 == 0 else list(reversed(bins))
        for name in order:
            stamp = time.strftime("%H:%M:%S", time.gmtime())
            runs, code = one(bins[name], a.runs, extra, a.priority)
            if runs is None:
                print(f"{stamp} {name}: load test failed (exit {code})", flush=True)
                continue
            for r in runs:
                got[name].append(r)
                print(f"{stamp} UTC {name}: single {r['single_tok_s']:.1f} tok/s, aggregate "
                      f"{r['aggregate_tok_s']:.1f} tok/s, ratio {r['speedup']:.2f}x, errors "
                      f"{r['errors']}, short {r['short']}, load {r['load']:.2f}, server CPU "
                      f"{r['server_cpu_s']:.2f} s", flush=True)
    for name in bins:
        rs = got[name]
        if not rs:
            print(f"{name} ({bins[name]}): no runs")
            continue
        ratio = sorted(r["speedup"] for r in rs)
        agg = sorted(r["aggregate_tok_s"] for r in rs)
        single = sorted(r["single_tok_s"] for r in rs)
        print(f"{name} ({bins[name]}): {len(rs)} runs; ratio min {ratio[0]:.2f} median "
              f"{statistics.median(ratio):.2f} max {ratio[-1]:.2f}; aggregate min {agg[0]:.1f} "
              f"median {statistics.median(agg):.1f} max {agg[-1]:.1f}; single median "
              f"{statistics.median(single):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
