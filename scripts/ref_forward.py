#!/usr/bin/env python3
"""An independent float64 forward pass of a llama-architecture GGUF file, for the last row's logits.

The weights are dequantized by the `gguf` Python package (not by this repo's code), every product
and the attention run in float64 with numpy: the model's "true" logits up to the weights'
quantization, against which a backend's choice on a near-tie can be judged. `--f16` rounds what
the CUDA backend's prompt path rounds to f16 (weights, GEMM operands, Q/K/V, attention
probabilities) to see what that precision alone moves.

    python3 scripts/ref_forward.py MODEL.gguf 1,9690,198,... [--f16] [--top 5]
    python3 scripts/ref_forward.py MODEL.gguf --fixture FIXTURE.json [--f16]

The first form prints the last row's top tokens with their logits and the lead of the first over
the second. The second feeds a teacher-forced fixture's tokens (scripts/ref_logits.py) and
compares llama.cpp's top-1 at every position with this reference's: how often llama.cpp itself
picks the float64 model's token, on all rows and on its decisive rows (its lead >= 0.1, the
conformance suite's definition). Slow but small models need seconds to minutes (SmolLM2-135M:
27 tokens ~15 s, the 453-token fixture ~1 min on 2 cores).
"""
import argparse

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("tokens", nargs="?", default="", help="comma-separated token ids")
    ap.add_argument("--fixture", help="a teacher-forced logits fixture (scripts/ref_logits.py)")
    ap.add_argument("--f16", action="store_true", help="round as the CUDA prompt path does")
    ap.add_argument("--top", type=int, default=5)
    a = ap.parse_args()
    fx = None
    if a.fixture:
        import json

        with open(a.fixture) as f:
            fx = json.load(f)
        toks = fx["tokens"]
    else:
        toks = [int(t) for t in a.tokens.split(",") if t]
    if not toks:
        ap.error("no tokens: give ids or --fixture")
    r = GGUFReader(a.model)
    fields = {f.name: f for f in r.fields.values()}

    def val(name):
        f = fields[name]
        return f.parts[f.data[0]].tolist()[0]

    arch = bytes(fields["general.architecture"].parts[-1]).decode()
    n_layer = val(f"{arch}.block_count")
    n_embd = val(f"{arch}.embedding_length")
    n_head = val(f"{arch}.attention.head_count")
    n_kv = val(f"{arch}.attention.head_count_kv")
    eps = val(f"{arch}.attention.layer_norm_rms_epsilon")
    theta = val(f"{arch}.rope.freq_base") if f"{arch}.rope.freq_base" in fields else 10000.0
    hd = n_embd // n_head
    tensors = {t.name: t for t in r.tensors}

    def weight(name):
        t = tensors[name]
        v = dequantize(t.data, t.tensor_type).astype(np.float64)
        return v.reshape([int(x) for x in t.shape][::-1])

    def f16(v):
        return v.astype(np.float16).astype(np.float64) if a.f16 else v

    emb = weight("token_embd.weight")
    out_w = weight("output.weight") if "output.weight" in tensors else emb
    n = len(toks)
    pos = np.arange(n)
    x = emb[toks].copy()

    def rms(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    def rope(v, heads):
        # GGUF llama layout: rotation pairs (2i, 2i + 1) of each head.
        v = v.reshape(n, heads, hd).copy()
        i = np.arange(hd // 2)
        ang = pos[:, None] * (theta ** (-2.0 * i / hd))[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        e, o = v[..., 0::2].copy(), v[..., 1::2].copy()
        v[..., 0::2] = e * c - o * s
        v[..., 1::2] = e * s + o * c
        return v

    def mm(v, w):
        return f16(v) @ f16(w).T

    g = n_head // n_kv
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for li in range(n_layer):
        p = f"blk.{li}."
        h = rms(x, weight(p + "attn_norm.weight"))
        q = f16(rope(mm(h, weight(p + "attn_q.weight")), n_head))
        k = f16(rope(mm(h, weight(p + "attn_k.weight")), n_kv))
        v = f16(mm(h, weight(p + "attn_v.weight")).reshape(n, n_kv, hd))
        att = np.zeros((n, n_head, hd))
        for hh in range(n_head):
            s = q[:, hh, :] @ k[:, hh // g, :].T / np.sqrt(hd) + mask
            s = f16(np.exp(s - s.max(-1, keepdims=True)))
            att[:, hh, :] = (s @ v[:, hh // g, :]) / s.sum(-1, keepdims=True)
        x = x + mm(att.reshape(n, n_embd), weight(p + "attn_output.weight"))
        h = rms(x, weight(p + "ffn_norm.weight"))
        gate, up = mm(h, weight(p + "ffn_gate.weight")), mm(h, weight(p + "ffn_up.weight"))
        x = x + mm(gate / (1 + np.exp(-gate)) * up, weight(p + "ffn_down.weight"))
    if fx is not None:
        logits = rms(x, weight("output_norm.weight")) @ out_w.T
        ours = logits.argmax(-1)
        rows = fx["positions"]
        same = [int(ours[i]) == r["ids"][0] for i, r in enumerate(rows)]
        dec = [s for s, r in zip(same, rows) if r["logits"][0] - r["logits"][1] >= 0.1]
        srt = np.sort(logits, -1)
        firm = [s for i, s in enumerate(same) if srt[i, -1] - srt[i, -2] >= 0.1]
        print(
            f"llama.cpp's top-1 = this reference's: {sum(same)}/{len(same)} rows "
            f"({sum(same) / len(same):.4f}); on llama.cpp's decisive rows {sum(dec)}/{len(dec)} "
            f"({sum(dec) / max(len(dec), 1):.4f}); on this reference's decisive rows "
            f"{sum(firm)}/{len(firm)} ({sum(firm) / max(len(firm), 1):.4f})"
        )
        return
    logits = (rms(x[-1:], weight("output_norm.weight")) @ out_w.T)[0]
    top = np.argsort(-logits)[: a.top]
    print("top:", ", ".join(f"{int(t)} {logits[t]:.3f}" for t in top))
    print(f"lead of the first over the second: {logits[top[0]] - logits[top[1]]:.3f}")


if __name__ == "__main__":
    main()
