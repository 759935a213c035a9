#!/usr/bin/env python3
"""Checks the KL estimators a ref_logits.py fixture supports against the exact KL.

Re-runs llama.cpp on the fixture's tokens to get the full logit rows, perturbs them with
Gaussian noise (a stand-in for "another engine"), and prints, for each noise level, the exact
mean KL(llama.cpp || perturbed), the estimate from the fixture's top-K plus tail samples, the
top-K-plus-rest-bucket lower bound, and the top-1 agreement. The tail-sample estimate should
track the exact value; the bucket bound sits below it.

Usage: python3 scripts/check_kl_estimator.py MODEL.gguf FIXTURE.json
"""

import json
import sys

import numpy as np


def lse(x: np.ndarray) -> np.ndarray:
    m = x.max(1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(1, keepdims=True)))[:, 0]


def main() -> int:
    import llama_cpp

    model, fixture = sys.argv[1:3]
    fx = json.load(open(fixture))
    n = fx["n_tokens"]
    llm = llama_cpp.Llama(model, n_ctx=n, n_batch=n, n_ubatch=n, n_threads=2,
                          n_threads_batch=2, logits_all=True, verbose=False)
    llm.eval(fx["tokens"])
    ref = np.asarray(llm.scores[:n], dtype=np.float64)
    rng = np.random.default_rng(5)
    for noise in (0.05, 0.2):
        ours = ref + rng.normal(0, noise, ref.shape)
        lr, lo = lse(ref), lse(ours)
        pr = np.exp(ref - lr[:, None])
        exact = (pr * ((ref - lr[:, None]) - (ours - lo[:, None]))).sum(1)
        est, bound, top1 = [], [], 0
        for i, p in enumerate(fx["positions"]):
            ids = np.array(p["ids"])
            z = np.array(p["logits"], dtype=np.float64)
            if not np.allclose(z, ref[i, ids], atol=1e-5):
                print(f"fixture row {i} differs from llama.cpp's logits now")
                return 1
            p_ref = np.exp(z - p["lse"])
            d = (z - p["lse"]) - (ours[i, ids] - lo[i])
            tail = 1 - p_ref.sum()
            t = np.array(p["tail_ids"])
            dt = (np.array(p["tail_logits"]) - p["lse"]) - (ours[i, t] - lo[i])
            est.append((p_ref * d).sum() + tail * dt.mean())
            p_ours = np.exp(ours[i, ids] - lo[i])
            bound.append((p_ref * np.log(p_ref / p_ours)).sum()
                         + tail * np.log(tail / (1 - p_ours.sum())))
            top1 += int(ours[i].argmax() == ids[0])
        print(f"noise {noise}: exact mean KL {exact.mean():.5f}, tail-sample estimate "
              f"{np.mean(est):.5f}, bucket lower bound {np.mean(bound):.5f}, "
              f"top-1 agreement {top1 / n:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
